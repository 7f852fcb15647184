// Shared console helpers: calls to the /v1 API with the session's CSRF token, forms that call the API, messages.
"use strict";

const ZayaConsole = (() => {
  const FLASH_KEY = "zaya-console-flash";

  class ApiError extends Error {
    constructor(status, message, param) {
      super(message);
      this.status = status;
      this.param = param;
    }
  }

  function csrfToken() {
    return document.querySelector('meta[name="csrf-token"]').content;
  }

  function signInAgain() {
    const next = location.pathname + location.search;
    location.href = "/console/login?ended=expired&next=" + encodeURIComponent(next);
  }

  async function readResult(response) {
    if (response.status === 401) {
      signInAgain();
      throw new ApiError(401, "Your session has ended.");
    }
    const data = await response.json().catch(() => null);
    if (!response.ok) {
      const error = (data && data.error) || {};
      throw new ApiError(response.status, error.message || response.statusText, error.param);
    }
    return data;
  }

  // `background` marks polling: it does not count as activity for the session's idle timeout.
  async function api(method, url, body, { background = false } = {}) {
    const headers = { "X-CSRF-Token": csrfToken(), Accept: "application/json" };
    if (background) headers["X-Console-Background"] = "1";
    const init = { method, headers, credentials: "same-origin" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    return readResult(await fetch(url, init));
  }

  function flash(message, kind = "ok") {
    const box = document.getElementById("flash");
    box.textContent = message;
    box.className = "flash " + kind;
    box.setAttribute("role", kind === "error" ? "alert" : "status");
    box.hidden = false;
  }

  // A message that survives the reload which shows an action's result.
  function flashAfterReload(message) {
    sessionStorage.setItem(FLASH_KEY, message);
    location.reload();
  }

  function formBody(form) {
    const body = {};
    for (const [name, value] of new FormData(form)) {
      if (value === "") continue;
      body[name] = value === "true" ? true : value;
    }
    return body;
  }

  function showSecret(created) {
    const box = document.getElementById("new-secret");
    const field = document.getElementById("new-secret-value");
    field.value = created.secret;
    box.hidden = false;
    field.focus();
    field.select();
    const table = document.querySelector("#keys tbody");
    if (table) {
      const row = table.insertRow(-1);
      row.dataset.keyId = created.id;
      const project = document.querySelector(`#key-project option[value="${created.project_id}"]`);
      const projectName = project ? project.textContent : created.project_id;
      for (const text of [created.name, created.role, projectName, created.prefix + "…", "just now", "—", "—", ""]) {
        row.insertCell(-1).textContent = text;
      }
    }
  }

  async function submitApiForm(form) {
    if (form.dataset.confirm && !window.confirm(form.dataset.confirm)) return;
    const buttons = form.querySelectorAll("button");
    buttons.forEach((button) => (button.disabled = true));
    try {
      const result = await api(form.dataset.method, form.dataset.url, formBody(form));
      if (form.dataset.showSecret) {
        showSecret(result);
        form.reset();
      } else if (result && result.object === "model_alias.approval" && result.status === "pending") {
        flashAfterReload(`Approval requested (${result.id}): a second admin must approve this move.`);
      } else {
        flashAfterReload(form.dataset.success || "Done.");
      }
    } catch (error) {
      flash(error.message, "error");
    } finally {
      buttons.forEach((button) => (button.disabled = false));
    }
  }

  document.addEventListener("submit", (event) => {
    const form = event.target.closest("form.api-form");
    if (!form) return;
    event.preventDefault();
    submitApiForm(form);
  });

  document.addEventListener("DOMContentLoaded", () => {
    const message = sessionStorage.getItem(FLASH_KEY);
    if (message) {
      sessionStorage.removeItem(FLASH_KEY);
      flash(message);
    }
  });

  return { api, flash, flashAfterReload, csrfToken, readResult, ApiError };
})();
