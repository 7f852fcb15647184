// Dataset upload with a progress bar; a refused file shows the validator's line-numbered report.
"use strict";

(() => {
  const form = document.getElementById("upload");
  const input = document.getElementById("upload-file");
  const progress = document.getElementById("upload-progress");
  const result = document.getElementById("upload-result");
  const report = document.getElementById("upload-report");

  function showProblems(message) {
    // The API's message: a summary line, then one "line N: field: problem" (or "file: ...") per problem.
    const [summary, ...lines] = message.split("\n");
    document.getElementById("upload-report-summary").textContent = summary;
    const body = document.getElementById("upload-problems");
    body.replaceChildren(
      ...lines.map((text) => {
        const match = /^line (\d+): (.*)$/.exec(text) || /^(file): (.*)$/.exec(text) || [null, "", text];
        const row = document.createElement("tr");
        row.insertCell(-1).textContent = match[1];
        row.insertCell(-1).textContent = match[2];
        return row;
      })
    );
    report.hidden = false;
  }

  function addRow(file) {
    const row = document.getElementById("files").insertRow(0);
    const link = document.createElement("a");
    link.href = `/console/datasets/${file.id}`;
    link.textContent = file.id;
    row.insertCell(-1).append(link);
    for (const text of [file.filename, file.bytes, "", "just now"]) row.insertCell(-1).textContent = text;
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const file = input.files[0];
    report.hidden = true;
    if (!file) return;
    if (file.size > Number(form.dataset.maxBytes)) {
      result.textContent = `${file.name} is larger than the upload limit of ${form.dataset.maxBytes} bytes.`;
      return;
    }
    const data = new FormData();
    data.append("purpose", "fine-tune");
    data.append("file", file);
    const request = new XMLHttpRequest();
    request.open("POST", "/v1/files");
    request.setRequestHeader("X-CSRF-Token", ZayaConsole.csrfToken());
    request.setRequestHeader("Accept", "application/json");
    progress.value = 0;
    progress.hidden = false;
    result.textContent = `Uploading ${file.name}…`;
    request.upload.addEventListener("progress", (step) => {
      if (step.lengthComputable) progress.value = (100 * step.loaded) / step.total;
    });
    request.addEventListener("load", () => {
      progress.value = 100;
      let body = null;
      try {
        body = JSON.parse(request.responseText);
      } catch {
        body = null;
      }
      if (request.status === 401) {
        location.href = "/console/login?ended=expired&next=/console/datasets";
      } else if (request.status === 200) {
        result.textContent = `Uploaded and valid: ${body.filename} is ${body.id}.`;
        addRow(body);
        form.reset();
      } else {
        const message = (body && body.error && body.error.message) || `Upload failed (${request.status}).`;
        result.textContent = `Refused: ${file.name}`;
        showProblems(message);
      }
    });
    request.addEventListener("error", () => {
      result.textContent = "The upload failed: the connection was lost.";
    });
    request.send(data);
  });
})();
