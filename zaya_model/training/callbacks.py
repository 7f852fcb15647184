"""Generic `transformers.Trainer` callbacks shared by pretraining and fine-tuning.

- `TrainingHooks`: the interface a caller (CLI, job worker) implements to see progress and to stop a run;
  `ProgressBarHooks` shows a run in a terminal.
- `HooksCallback`: forwards the Trainer's logs as metrics events and polls `hooks.should_stop()` after every step;
  "cancel" stops at once, "pause" saves a checkpoint (with optimizer state) and then stops. List it after the
  Trainer's default callbacks (the default) so its end-of-epoch override wins.
- `WallTimeCallback`: a hard cap on training time, checked after every step.
- `NonFiniteLossCallback`: fails the run on a NaN or infinite training loss instead of training on garbage.

Set `logging_steps=1` and `logging_nan_inf_filter=False` in `TrainingArguments`: the callbacks read the loss from
the logs, and the default filter would hide a non-finite loss.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

STOP_REASONS = ("cancel", "pause")
# The info event a run with compiled layers sends before its first step, which is silent while it compiles.
COMPILING_MESSAGE = "compiled layers: the first steps compile them (tens of seconds on CPU)"

# Trainer log keys, renamed to the names our job events use (as OpenAI's fine-tuning metrics do).
_METRIC_NAMES = {
    "loss": "train_loss",
    "eval_valid_loss": "valid_loss",
    "eval_valid_mean_token_accuracy": "valid_mean_token_accuracy",
    "learning_rate": "learning_rate",
    "grad_norm": "grad_norm",
    "epoch": "epoch",
}


class TrainingHooks:
    """No-op base: subclass and override what you need. Methods are called from the training thread."""

    def on_event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        """A human-readable event; `level` is "info", "warning" or "error"."""

    def on_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Metrics logged at `step`: train_loss every step; valid_loss, valid_mean_token_accuracy after an eval."""

    def on_checkpoint(self, step: int, path: str, metrics: dict[str, Any]) -> None:
        """A checkpoint was written (atomically) to `path`."""

    def on_checkpoint_deleted(self, step: int, path: str) -> None:
        """An older checkpoint was removed by rotation (only the newest K and the best are kept)."""

    def should_stop(self) -> str | None:
        """Polled after every optimizer step: None to go on, "cancel" to stop, "pause" to checkpoint then stop."""
        return None


class ProgressBarHooks(TrainingHooks):
    """TrainingHooks for a terminal: a tqdm bar over optimizer steps, events and evaluations as lines above it."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        from tqdm import tqdm

        if data and "max_steps" in data and self.bar is None:
            self.bar = tqdm(total=data["max_steps"], initial=data["step"], unit="step", dynamic_ncols=True)
        self._write(f"{level}: {message}")

    def on_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        if self.bar is None:
            return
        if "train_loss" in metrics:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{metrics['train_loss']:.4f}")
        if "valid_loss" in metrics:
            accuracy = metrics.get("valid_mean_token_accuracy", float("nan"))
            self._write(f"step {step}: valid loss {metrics['valid_loss']:.4f}, token accuracy {accuracy:.4f}")

    def on_checkpoint(self, step: int, path: str, metrics: dict[str, Any]) -> None:
        self._write(f"step {step}: checkpoint {path}")

    def on_checkpoint_deleted(self, step: int, path: str) -> None:
        self._write(f"step {step}: removed older checkpoint {path}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _write(self, line: str) -> None:
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


def rename_metrics(logs: dict) -> dict:
    return {_METRIC_NAMES[key]: value for key, value in logs.items() if key in _METRIC_NAMES}


class HooksCallback(TrainerCallback):
    """Metrics to `hooks.on_metrics`, cooperative stop from `hooks.should_stop`. `stop_reason` tells why it stopped."""

    def __init__(self, hooks: TrainingHooks):
        self.hooks = hooks
        self.stop_reason: str | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        data = {"step": state.global_step, "max_steps": state.max_steps}
        where = ""
        if args.device.type == "cpu":
            data["cpu_threads"] = torch.get_num_threads()
            where = f" on the CPU with {data['cpu_threads']} thread{'s' if data['cpu_threads'] > 1 else ''}"
        self.hooks.on_event("info", f"training from step {state.global_step} of {state.max_steps}{where}", data)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        metrics = rename_metrics(logs or {})
        if set(metrics) - {"epoch"}:  # the end-of-training summary carries nothing new
            self.hooks.on_metrics(state.global_step, metrics)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        request = self.hooks.should_stop()
        if request is None:
            return
        if request not in STOP_REASONS:
            raise ValueError(f"should_stop() returned {request!r}; expected None, 'cancel' or 'pause'")
        self.stop_reason = request
        control.should_training_stop = True
        if request == "pause":
            control.should_save = True
        self.hooks.on_event("info", f"{request} requested at step {state.global_step}", {"step": state.global_step})

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.stop_reason is not None:  # stopping now: no end-of-epoch evaluation or extra checkpoint
            control.should_evaluate = False
            control.should_save = False


class WallTimeCallback(TrainerCallback):
    """Stops training (saving a checkpoint) once `max_seconds` have passed since training began."""

    def __init__(self, max_seconds: float, hooks: TrainingHooks | None = None):
        self.max_seconds = max_seconds
        self.hooks = hooks or TrainingHooks()
        self.started: float | None = None
        self.reached = False

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.started = time.monotonic()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.started is None or time.monotonic() - self.started < self.max_seconds:
            return
        self.reached = True
        control.should_training_stop = True
        control.should_save = True
        message = f"wall-time cap of {self.max_seconds:g} s reached at step {state.global_step}"
        self.hooks.on_event("warning", message, {"step": state.global_step})


class NonFiniteLossCallback(TrainerCallback):
    """Raises `NonFiniteLossError` as soon as a logged training loss is NaN or infinite."""

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            raise NonFiniteLossError(
                f"training loss is {loss} at step {state.global_step}; lower the learning rate or check the data"
            )
