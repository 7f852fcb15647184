// The playground: streams a chat completion from the API and shows the exact request it sent.
"use strict";

(() => {
  const form = document.getElementById("chat");
  const conversation = document.getElementById("conversation");
  const requestView = document.getElementById("pg-request");
  const usageView = document.getElementById("pg-usage");
  const send = document.getElementById("pg-send");
  let history = [];

  function addMessage(role, text) {
    const item = document.createElement("li");
    item.className = `message ${role}`;
    const who = document.createElement("strong");
    who.textContent = role === "user" ? "You" : "Model";
    const body = document.createElement("span");
    body.className = "content";
    body.textContent = text;
    item.append(who, " ", body);
    conversation.append(item);
    return body;
  }

  function buildRequest() {
    const value = (name) => form.elements[name].value.trim();
    const messages = [];
    if (value("system")) messages.push({ role: "system", content: value("system") });
    const request = {
      model: value("model"),
      messages: [...messages, ...history],
      temperature: Number(value("temperature")),
      top_p: Number(value("top_p")),
      max_tokens: Number(value("max_tokens")),
      stream: true,
      stream_options: { include_usage: true },
    };
    if (value("seed") !== "") request.seed = Number(value("seed"));
    return request;
  }

  async function stream(request, output) {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      credentials: "same-origin",
      headers: {
        "Content-Type": "application/json",
        Accept: "text/event-stream",
        "X-CSRF-Token": ZayaConsole.csrfToken(),
      },
      body: JSON.stringify(request),
    });
    if (!response.ok) await ZayaConsole.readResult(response); // throws the API's error
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let text = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return text;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
          if (delta && delta.content) {
            text += delta.content;
            output.textContent = text;
          }
          if (chunk.usage) {
            usageView.textContent = `${chunk.usage.prompt_tokens} prompt + ${chunk.usage.completion_tokens} completion tokens`;
          }
        }
      }
    }
    return text;
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const message = form.elements.message.value.trim();
    if (!message) return;
    history.push({ role: "user", content: message });
    addMessage("user", message);
    form.elements.message.value = "";
    const request = buildRequest();
    requestView.textContent = JSON.stringify(request, null, 2);
    usageView.textContent = "";
    const output = addMessage("assistant", "…");
    output.parentElement.setAttribute("aria-busy", "true");
    send.disabled = true;
    try {
      const answer = await stream(request, output);
      output.textContent = answer;
      history.push({ role: "assistant", content: answer });
      conversation.dataset.done = String(history.length);
    } catch (error) {
      output.textContent = "";
      output.parentElement.classList.add("error");
      ZayaConsole.flash(error.message, "error");
      history.pop();
    } finally {
      output.parentElement.removeAttribute("aria-busy");
      send.disabled = false;
      form.elements.message.focus();
    }
  });

  document.getElementById("pg-clear").addEventListener("click", () => {
    history = [];
    conversation.replaceChildren();
    requestView.textContent = "—";
    usageView.textContent = "";
  });
})();
