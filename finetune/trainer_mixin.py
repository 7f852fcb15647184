"""The `transformers.Trainer` behaviour every fine-tuning run shares, supervised (`finetune.run`) and preference
(`finetune.preference`): atomic checkpoints reported to the hooks and rotated, a last checkpoint when a run ends off
the schedule, the count of trained tokens, and the run's final metrics.

Trained tokens are billed as OpenAI bills them: every token that carries loss, counted each time it is trained (so a
dataset's trained tokens times the epochs for a run that completes its epochs). Each training step adds its batch's
count; a checkpoint stores the running total (`TRAINED_TOKENS_FILE`) and a resumed run continues from it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from zaya_model.training.atomic_io import publish_directory, write_json_atomic
from zaya_model.training.callbacks import HooksCallback, TrainingHooks, rename_metrics
from zaya_model.training.checkpoint_dirs import CheckpointWriteError, checkpoint_name, rotate_checkpoints

from .artifacts import (
    BASE_MODEL_FILE,
    METRICS_FILE,
    TRAINED_TOKENS_FILE,
    read_json,
    save_generation_files,
)
from .balancing_callback import BalancingBiasCallback
from .data import IGNORE_INDEX

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

CHECKPOINT_METRICS = ("train_loss", "valid_loss", "valid_mean_token_accuracy")


class CheckpointedTraining(Trainer):
    """A `transformers.Trainer` that a run's trainer class combines with (listed first): checkpoints are written
    atomically, carry metrics.json, the generation files and the base model's fingerprint, and are reported to the
    hooks; only the newest `keep_checkpoints` and the best stay on disk."""

    def __init__(
        self,
        *args: Any,
        hooks: TrainingHooks,
        fingerprint: str | None,
        balancing: BalancingBiasCallback | None,
        keep_checkpoints: int | None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.hooks = hooks
        self.fingerprint = fingerprint
        self.balancing = balancing
        self.keep_checkpoints = keep_checkpoints
        self.checkpoints: dict[int, dict[str, Any]] = {}
        self._staging_root: str | None = None
        # None once unknown: a run resumed from a checkpoint that did not record its count.
        self.trained_tokens: int | None = 0
        self.trained_tokens_this_run = 0

    def resume_trained_tokens(self, checkpoint_dir: str) -> None:
        """Continue the count of the run that wrote `checkpoint_dir`."""
        recorded = read_json(Path(checkpoint_dir) / TRAINED_TOKENS_FILE)
        value = recorded.get("trained_tokens") if isinstance(recorded, dict) else None
        self.trained_tokens = value if isinstance(value, int) and value >= 0 else None

    def count_trained_tokens(self, inputs: dict[str, Any]) -> int:
        """The tokens of a training batch that carry loss: the labels a position predicts (labels shifted by one,
        as the causal-LM loss reads them) that are not -100. A preference trainer counts its own way."""
        return int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        count = self.count_trained_tokens(inputs)
        if self.accelerator.num_processes > 1:  # data-parallel: the step trained on every process's batch
            local = torch.tensor(count, device=self.accelerator.device)
            count = int(self.accelerator.reduce(local, reduction="sum"))
        loss = super().training_step(model, inputs, *args, **kwargs)
        self.trained_tokens_this_run += count
        if self.trained_tokens is not None:
            self.trained_tokens += count
        return loss

    def _get_output_dir(self, trial: Any) -> str:
        return self._staging_root or super()._get_output_dir(trial)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Data-parallel: every process writes its RNG state into the staging directory, the first one the rest,
        publishes it and reports it; none goes on before it is published."""
        run_dir = super()._get_output_dir(trial)
        name = checkpoint_name(self.state.global_step)
        first = self.is_world_process_zero()
        os.makedirs(run_dir, exist_ok=True)
        staging_root = self._staging_root = os.path.join(run_dir, f".{name}.partial")
        try:
            super()._save_checkpoint(model, trial)  # writes into the staging root
            self.accelerator.wait_for_everyone()
            metrics = self.checkpoint_metrics()
            if first:
                self._publish(Path(staging_root) / name, run_dir, name, metrics)
        except Exception as error:  # torch, safetensors and json each raise their own type for a full disk
            raise CheckpointWriteError(f"could not write checkpoint {name} in {run_dir}: {error}") from error
        finally:
            if first:
                shutil.rmtree(staging_root, ignore_errors=True)
            self._staging_root = None
        self.accelerator.wait_for_everyone()
        best = self._best_checkpoint(run_dir)
        if best is not None and os.path.isdir(best):
            self.state.best_model_checkpoint = best
        if not first:
            return
        path = os.path.join(run_dir, name)
        self.checkpoints[self.state.global_step] = {"step": self.state.global_step, "path": path, "metrics": metrics}
        self.hooks.on_checkpoint(self.state.global_step, path, metrics)
        if self.keep_checkpoints is not None:
            self._rotate(run_dir, self.keep_checkpoints)

    def _publish(self, staging: Path, run_dir: str, name: str, metrics: dict[str, Any]) -> None:
        """Complete the staging directory (state, generation files, fingerprint, biases, metrics), then rename it."""
        # The Trainer looked for the best checkpoint in the staging root; point it at the published one.
        best = self._best_checkpoint(run_dir)
        if best is not None and (self.state.best_global_step == self.state.global_step or os.path.isdir(best)):
            self.state.best_model_checkpoint = best
        self.state.save_to_json(str(staging / "trainer_state.json"))
        save_generation_files(staging, self.trained_model, self.processing_class)
        if self.fingerprint:
            write_json_atomic(staging / BASE_MODEL_FILE, {"fingerprint": self.fingerprint})
        if self.balancing is not None:
            self.balancing.save(staging)
        if self.trained_tokens is not None:
            write_json_atomic(staging / TRAINED_TOKENS_FILE, {"trained_tokens": self.trained_tokens})
        write_json_atomic(staging / METRICS_FILE, metrics)
        publish_directory(staging, Path(run_dir) / name)

    def _best_checkpoint(self, run_dir: str) -> str | None:
        """Where the best checkpoint is (or will be) published, once an evaluation has chosen one."""
        best_step = self.state.best_global_step
        return os.path.join(run_dir, checkpoint_name(best_step)) if best_step else None

    def _rotate(self, run_dir: str, keep_checkpoints: int) -> None:
        """Keep the newest `keep_checkpoints` and the best (which `load_best_model_at_end` reloads at the end)."""
        for step in rotate_checkpoints(run_dir, keep_checkpoints, self.state.best_global_step or None):
            record = self.checkpoints.pop(step, None)
            self.hooks.on_checkpoint_deleted(
                step, record["path"] if record else os.path.join(run_dir, checkpoint_name(step))
            )

    @property
    def trained_model(self) -> PreTrainedModel | PeftModel:
        """The model being trained: the Trainer types it as any module, a run always gives it a `PreTrainedModel`
        (a `PeftModel` for LoRA)."""
        return cast("PreTrainedModel | PeftModel", self.model)

    def checkpoint_metrics(self) -> dict[str, Any]:
        """OpenAI's checkpoint metrics: step, the latest train loss, the latest validation loss and token accuracy."""
        metrics: dict[str, Any] = {"step": self.state.global_step}
        for entry in self.state.log_history:
            if entry.get("step", 0) <= self.state.global_step:
                metrics.update({k: v for k, v in rename_metrics(entry).items() if k in CHECKPOINT_METRICS})
        return metrics

    def checkpoint_records(self) -> list[dict[str, Any]]:
        return [self.checkpoints[step] for step in sorted(self.checkpoints)]


class FinalCheckpointCallback(TrainerCallback):
    """One checkpoint, with a fresh evaluation, when training ends early or on a step the schedule would skip.

    With per-epoch evaluation the Trainer evaluates and saves at the end of the (possibly cut) epoch, so the save it
    also asks for at the last step is dropped; with per-step evaluation the last step gets both. A pause saves at
    once and a cancel saves nothing (`HooksCallback` also drops their end-of-epoch evaluation and save).
    """

    def __init__(self, stop: HooksCallback):
        self.stop = stop

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.stop.stop_reason is not None or not control.should_training_stop:
            return
        if args.save_strategy == "epoch":
            control.should_save = False
        elif state.global_step % args.save_steps != 0:
            control.should_evaluate = args.eval_strategy != "no"
            control.should_save = True


def final_metrics(trainer: CheckpointedTraining, train_output_metrics: dict[str, Any]) -> dict[str, Any]:
    metrics = trainer.checkpoint_metrics()
    runtime = train_output_metrics.get("train_runtime")
    metrics["train_runtime"] = runtime
    metrics["epoch"] = trainer.state.epoch
    metrics["trained_tokens"] = trainer.trained_tokens
    # This run's throughput (a resumed run's own steps over its own time): what the API's estimates read back.
    if runtime and trainer.trained_tokens_this_run:
        metrics["trained_tokens_per_second"] = trainer.trained_tokens_this_run / runtime
    if trainer.state.best_metric is not None:
        metrics["best_valid_loss"] = trainer.state.best_metric
        metrics["best_step"] = trainer.state.best_global_step
    return metrics
