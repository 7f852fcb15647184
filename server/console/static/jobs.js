// The new-job form: builds an OpenAI fine-tuning job request and posts it to the API.
"use strict";

(() => {
  const form = document.getElementById("new-job");
  const error = document.getElementById("new-job-error");
  if (!form) return;

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const value = (name) => form.elements[name].value.trim();
    const type = value("type");
    const hyperparameters = {
      n_epochs: Number(value("n_epochs")),
      max_steps: Number(value("max_steps")),
      eval_every: Number(value("eval_every")),
    };
    if (type === "dpo" && value("beta")) hyperparameters.beta = Number(value("beta"));
    const body = {
      model: value("model"),
      training_file: value("training_file"),
      seed: Number(value("seed") || 0),
      // OpenAI's method object: the chosen type and its block.
      method: { type, [type]: { adapter: value("adapter"), hyperparameters } },
    };
    if (value("validation_file")) body.validation_file = value("validation_file");
    if (value("suffix")) body.suffix = value("suffix");
    error.hidden = true;
    try {
      const job = await ZayaConsole.api("POST", "/v1/fine_tuning/jobs", body);
      location.href = `/console/jobs/${job.id}`;
    } catch (failure) {
      error.textContent = (failure.param ? `${failure.param}: ` : "") + failure.message;
      error.hidden = false;
    }
  });
})();
