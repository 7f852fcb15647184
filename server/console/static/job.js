// The job page: polls the fine-tuning API for status, events and checkpoints, and draws the loss curves.
"use strict";

(() => {
  const root = document.getElementById("job");
  const jobId = root.dataset.jobId;
  const base = `/v1/fine_tuning/jobs/${jobId}`;
  const FINISHED = new Set(["succeeded", "failed", "cancelled"]);
  const POLL_MS = 1500; // three requests a poll: well inside the per-key rate limit
  const events = new Map(); // event number -> event, from the API
  let maxSteps = Number(root.dataset.maxSteps) || null;

  const eventNumber = (id) => Number(String(id).replace("ftevent-", ""));
  const when = (unix) => new Date(unix * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
  const number = (value) => (typeof value === "number" ? value.toFixed(4) : "—");

  async function loadAllEvents() {
    let after = null;
    for (;;) {
      const query = after ? `?limit=1000&after=${after}` : "?limit=1000";
      const page = await ZayaConsole.api("GET", `${base}/events${query}`, undefined, { background: true });
      page.data.forEach((event) => events.set(eventNumber(event.id), event));
      if (!page.has_more || page.data.length === 0) return;
      after = page.data[page.data.length - 1].id;
    }
  }

  function series() {
    const train = [];
    const valid = [];
    for (const event of [...events.values()].sort((a, b) => eventNumber(a.id) - eventNumber(b.id))) {
      const data = event.data || {};
      if (event.type === "metrics" && typeof data.step === "number") {
        const trainLoss = data.train_loss ?? data.loss;
        if (typeof trainLoss === "number") train.push([data.step, trainLoss]);
        if (typeof data.valid_loss === "number") valid.push([data.step, data.valid_loss]);
      }
      if (typeof data.max_steps === "number" && data.max_steps > 0) maxSteps = data.max_steps;
    }
    return { train, valid };
  }

  function svg(name, attributes, text) {
    const element = document.createElementNS("http://www.w3.org/2000/svg", name);
    for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
    if (text !== undefined) element.textContent = text;
    return element;
  }

  function drawChart({ train, valid }) {
    const chart = document.getElementById("loss-chart");
    const [width, height, left, right, top, bottom] = [640, 260, 56, 12, 12, 32];
    chart.replaceChildren();
    const all = [...train, ...valid];
    if (all.length === 0) {
      chart.append(svg("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, "No metrics yet"));
      return;
    }
    const xMax = Math.max(maxSteps || 0, ...all.map(([step]) => step), 1);
    let yMin = Math.min(...all.map(([, loss]) => loss));
    let yMax = Math.max(...all.map(([, loss]) => loss));
    if (yMax - yMin < 1e-9) [yMin, yMax] = [yMin - 0.5, yMax + 0.5];
    const x = (step) => left + (step / xMax) * (width - left - right);
    const y = (loss) => top + (1 - (loss - yMin) / (yMax - yMin)) * (height - top - bottom);
    chart.append(svg("line", { x1: left, y1: height - bottom, x2: width - right, y2: height - bottom, class: "axis" }));
    chart.append(svg("line", { x1: left, y1: top, x2: left, y2: height - bottom, class: "axis" }));
    for (const loss of [yMin, (yMin + yMax) / 2, yMax]) {
      chart.append(svg("text", { x: left - 6, y: y(loss) + 4, "text-anchor": "end", class: "tick" }, loss.toFixed(2)));
    }
    chart.append(svg("text", { x: left, y: height - 10, class: "tick" }, "0"));
    chart.append(svg("text", { x: width - right, y: height - 10, "text-anchor": "end", class: "tick" }, `step ${xMax}`));
    const line = (points, name) => {
      if (points.length === 0) return;
      const coordinates = points.map(([step, loss]) => `${x(step).toFixed(1)},${y(loss).toFixed(1)}`).join(" ");
      chart.append(svg("polyline", { points: coordinates, class: `series ${name}`, "data-series": name }));
      for (const [step, loss] of points.slice(-1)) {
        chart.append(svg("circle", { cx: x(step), cy: y(loss), r: 3, class: `series ${name}` }));
      }
    };
    line(train, "train");
    line(valid, "valid");
    const last = (points) => (points.length ? points[points.length - 1][1].toFixed(3) : "none");
    chart.setAttribute("aria-label", `Loss by step: latest training loss ${last(train)}, validation ${last(valid)}`);
  }

  function renderEvents() {
    const list = document.getElementById("events");
    const items = [...events.values()].sort((a, b) => eventNumber(b.id) - eventNumber(a.id));
    list.replaceChildren(
      ...items.map((event) => {
        const item = document.createElement("li");
        item.dataset.eventId = event.id;
        item.className = `level-${event.level}`;
        const time = document.createElement("time");
        time.textContent = when(event.created_at);
        item.append(time, " " + event.message);
        return item;
      })
    );
  }

  // The task evaluation the run reports at its end (as the server renders it: templating._task_evaluation).
  function renderEvaluation() {
    const reported = [...events.values()].filter((event) => event.data && event.data.task_evaluation);
    if (reported.length === 0) return;
    const evaluation = reported.sort((a, b) => eventNumber(b.id) - eventNumber(a.id))[0].data.task_evaluation;
    if (typeof evaluation.exact_match !== "number") return;
    const fields = Object.entries(evaluation.fields || {}).map(([name, field]) => `${name} ${field.accuracy.toFixed(3)}`);
    const line = `exact match ${evaluation.exact_match.toFixed(3)} (${evaluation.n_examples} examples)`;
    document.getElementById("job-evaluation").textContent = fields.length ? `${line}; ${fields.join(", ")}` : line;
  }

  function renderJob(job) {
    renderEvaluation();
    const status = document.getElementById("job-status");
    status.textContent = job.status;
    status.className = `status status-${job.status}`;
    document.getElementById("job-model").textContent = job.fine_tuned_model || "—";
    document.getElementById("job-error").textContent = job.error ? job.error.message : "—";
    const allowed = {
      pause: ["queued", "running"].includes(job.status),
      resume: job.status === "paused",
      cancel: !FINISHED.has(job.status),
    };
    for (const button of root.querySelectorAll("[data-job-action]")) {
      button.disabled = !allowed[button.dataset.jobAction];
    }
    const { train } = series();
    const step = Math.max(0, ...[...events.values()].filter((e) => e.type === "metrics").map((e) => e.data.step));
    const progress = document.getElementById("job-progress");
    progress.value = job.status === "succeeded" ? 1 : maxSteps ? Math.min(1, step / maxSteps) : 0;
    document.getElementById("job-step").textContent = `step ${step}${maxSteps ? " / " + maxSteps : ""}`;
    root.dataset.points = String(train.length);
  }

  function renderCheckpoints(page) {
    const body = document.querySelector("#checkpoints tbody");
    body.replaceChildren(
      ...page.data.map((checkpoint) => {
        const row = document.createElement("tr");
        const metrics = checkpoint.metrics || {};
        for (const text of [
          checkpoint.step_number,
          number(metrics.train_loss),
          number(metrics.valid_loss),
          number(metrics.valid_mean_token_accuracy),
          when(checkpoint.created_at),
        ]) {
          row.insertCell(-1).textContent = text;
        }
        return row;
      })
    );
  }

  async function refresh() {
    const options = { background: true };
    const [job, recent, checkpoints] = await Promise.all([
      ZayaConsole.api("GET", base, undefined, options),
      ZayaConsole.api("GET", `${base}/events?limit=100`, undefined, options),
      ZayaConsole.api("GET", `${base}/checkpoints?limit=100`, undefined, options),
    ]);
    recent.data.forEach((event) => events.set(eventNumber(event.id), event));
    renderJob(job);
    renderEvents();
    renderCheckpoints(checkpoints);
    drawChart(series());
    return job;
  }

  async function poll() {
    try {
      const job = await refresh();
      if (FINISHED.has(job.status)) {
        root.dataset.live = "done";
        return;
      }
    } catch (error) {
      ZayaConsole.flash(`Live updates paused: ${error.message}`, "error");
    }
    setTimeout(poll, POLL_MS);
  }

  root.addEventListener("click", async (event) => {
    const button = event.target.closest("[data-job-action]");
    if (!button) return;
    const action = button.dataset.jobAction;
    if (action === "cancel" && !window.confirm("Cancel this job?")) return;
    try {
      const job = await ZayaConsole.api("POST", `${base}/${action}`);
      ZayaConsole.flash(`Job is ${job.status}.`);
      renderJob(job);
    } catch (error) {
      ZayaConsole.flash(error.message, "error");
    }
  });

  document.addEventListener("DOMContentLoaded", async () => {
    root.dataset.live = "on";
    try {
      await loadAllEvents();
    } catch (error) {
      ZayaConsole.flash(error.message, "error");
    }
    poll();
  });
})();
