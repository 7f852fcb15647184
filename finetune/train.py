"""LoRA (PEFT) or full fine-tuning of a ZAYA checkpoint on a chat / prompt-completion / text JSONL dataset.

`run_finetune(spec, hooks)` is what `zaya finetune` and the server's job worker call. It validates the spec and the
dataset, trains with `transformers.Trainer` (assistant-only loss, packing without cross-example leakage, validation
loss and mean token accuracy every `eval_every` steps, early stopping, best checkpoint kept), and writes:

    output_dir/checkpoints/checkpoint-N/   Trainer checkpoints (weights or adapter, optimizer, RNG, metrics.json)
    output_dir/final/                      the adapter (PeftModel.from_pretrained) or full checkpoint
    output_dir/merged/                     with merge_adapter: the adapter merged into a full checkpoint

Every directory is written under a temporary name and renamed into place. Errors: `FinetuneError` (bad spec or
dataset; the message starts with the field name), `CheckpointWriteError` (disk full or unwritable; earlier checkpoints
stay intact), `NonFiniteLossError` (the loss diverged).

Full fine-tuning updates the routers' balancing biases after every optimizer step as pretraining does
(`finetune.balancing`); LoRA leaves them as the base model has them. With `keep_checkpoints` set, only the newest
that many checkpoints and the best by validation loss stay on disk (`finetune.rotation`).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    AutoTokenizer,
    EarlyStoppingCallback,
    EvalPrediction,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from zaya_model import ZayaConfig, ZayaForCausalLM
from zaya_model.atomic_io import write_json_atomic
from zaya_model.pretrain import generation_eos_token_ids
from zaya_model.training.callbacks import (
    COMPILING_MESSAGE,
    HooksCallback,
    NonFiniteLossCallback,
    TrainingHooks,
    WallTimeCallback,
    rename_metrics,
)

from .artifacts import (
    BASE_MODEL_FILE,
    METRICS_FILE,
    atomic_directory,
    base_model_fingerprint,
    publish_directory,
    save_generation_files,
)
from .balancing import BalancingBiasCallback
from .data import IGNORE_INDEX, TokenizedDataset, make_collator, read_examples, token_statistics
from .datasets.validation import ValidationReport, validate_dataset
from .rotation import rotate_checkpoints

METHODS = ("lora", "full")
DEFAULT_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "o_proj"]
LORA_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# learning rate = base rate of the method x learning_rate_multiplier
BASE_LEARNING_RATE = {"lora": 2e-4, "full": 2e-5}
# "auto" epochs: aim for this many examples seen in total, within [1, MAX_AUTO_EPOCHS] (as OpenAI's API does)
MIN_TARGET_EXAMPLES, MAX_TARGET_EXAMPLES, DEFAULT_EPOCHS, MAX_AUTO_EPOCHS = 3_000, 25_000, 3, 25
LIMITS = {"n_epochs": (1, 100), "batch_size": (1, 1024), "lora_r": (1, 1024), "max_seq_len": (2, 1 << 24)}
MAX_LEARNING_RATE_MULTIPLIER = 100.0
MAX_PROBLEMS_SHOWN = 10
CHECKPOINT_METRICS = ("train_loss", "valid_loss", "valid_mean_token_accuracy")

__all__ = [
    "CheckpointWriteError",
    "FinetuneError",
    "FinetuneResult",
    "FinetuneSpec",
    "TrainingHooks",
    "resolve_hyperparameters",
    "run_finetune",
    "validate_spec",
]


class FinetuneError(ValueError):
    """Bad spec or dataset; the message names the field or the lines at fault."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (full disk, permissions); earlier checkpoints are intact."""


@dataclass
class FinetuneSpec:
    model_dir: str
    train_file: str
    output_dir: str
    validation_file: str | None = None
    method: str = "lora"  # "lora" | "full"
    n_epochs: int | str = "auto"
    batch_size: int | str = "auto"
    learning_rate_multiplier: float | str = "auto"
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None  # default: the attention projections
    lora_target_experts: bool = True  # also LoRA on the fused experts (PEFT target_parameters)
    max_steps: int | None = None
    max_seconds: float | None = None
    eval_every: int | None = None  # steps; None: once per epoch
    early_stopping_patience: int | None = None  # evaluations without a better validation loss
    seed: int = 0
    max_seq_len: int | None = None  # default: the model's max_position_embeddings
    packing: bool = True
    merge_adapter: bool = False
    keep_checkpoints: int | None = None  # keep the newest N checkpoints (and the best); None keeps every one
    balancing_bias_lr: float = 1e-3  # full fine-tuning's balancing-bias update rate (as pretraining); 0: off
    gradient_checkpointing: bool = False  # recompute layers in the backward pass: less memory, ~one more forward
    compile: bool = False  # each block's attention, routing and merge as compiled graphs (the first step compiles)


@dataclass
class FinetuneResult:
    status: str  # "succeeded" | "cancelled" | "paused"
    output_dir: str | None  # the final adapter / full checkpoint (merged one with merge_adapter); None unless succeeded
    kind: str  # "adapter" | "full"
    metrics: dict = field(default_factory=dict)
    checkpoints: list[dict] = field(default_factory=list)  # each {"step", "path", "metrics": {...}}


@dataclass(frozen=True)
class Hyperparameters:
    n_epochs: int
    batch_size: int
    learning_rate: float


def validate_spec(spec: FinetuneSpec) -> None:
    """Check every field that can be checked without loading anything heavy; raise FinetuneError naming the field."""
    _check_dir(spec.model_dir, "model_dir")
    _check_file(spec.train_file, "train_file")
    if spec.validation_file is not None:
        _check_file(spec.validation_file, "validation_file")
    if not isinstance(spec.output_dir, str) or not spec.output_dir:
        raise FinetuneError("output_dir: must be a directory path")
    if os.path.isfile(spec.output_dir):
        raise FinetuneError(f"output_dir: {spec.output_dir} is a file")
    if spec.method not in METHODS:
        raise FinetuneError(f"method: must be 'lora' or 'full', got {spec.method!r}")
    for name in ("n_epochs", "batch_size"):
        value = getattr(spec, name)
        if value != "auto":
            _check_int(name, value, *LIMITS[name])
    multiplier = spec.learning_rate_multiplier
    if multiplier != "auto":
        _check_number("learning_rate_multiplier", multiplier, 0.0, MAX_LEARNING_RATE_MULTIPLIER, open_low=True)
    if spec.method == "lora":
        _check_int("lora_r", spec.lora_r, *LIMITS["lora_r"])
        _check_number("lora_alpha", spec.lora_alpha, 0.0, math.inf, open_low=True)
        _check_number("lora_dropout", spec.lora_dropout, 0.0, 1.0, open_high=True)
        targets = spec.lora_target_modules
        if targets is not None and (
            not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets)
        ):
            raise FinetuneError("lora_target_modules: must be a non-empty list of module names")
    elif spec.merge_adapter:
        raise FinetuneError("merge_adapter: only a LoRA run has an adapter to merge (method is 'full')")
    _check_number("balancing_bias_lr", spec.balancing_bias_lr, 0.0, 1.0)
    for name in ("max_steps", "eval_every", "early_stopping_patience", "keep_checkpoints"):
        if getattr(spec, name) is not None:
            _check_int(name, getattr(spec, name), 1, 1 << 40)
    if spec.max_seconds is not None:
        _check_number("max_seconds", spec.max_seconds, 0.0, math.inf, open_low=True)
    if spec.max_seq_len is not None:
        _check_int("max_seq_len", spec.max_seq_len, *LIMITS["max_seq_len"])
    if spec.early_stopping_patience is not None and spec.validation_file is None:
        raise FinetuneError("early_stopping_patience: needs a validation_file to measure the validation loss")
    if isinstance(spec.seed, bool) or not isinstance(spec.seed, int) or not 0 <= spec.seed < 2**32:
        raise FinetuneError(f"seed: must be an integer in [0, 2**32), got {spec.seed!r}")


def resolve_hyperparameters(spec: FinetuneSpec, n_examples: int) -> Hyperparameters:
    """Turn "auto" into numbers from the dataset size: batch ~0.2% of the examples (power of two, at most 32),
    epochs so that 3,000–25,000 examples are seen (default 3), learning-rate multiplier 1."""
    batch_size = spec.batch_size
    if batch_size == "auto":
        batch_size = min(32, 2 ** int(math.log2(max(1, n_examples // 500))))
    n_epochs = spec.n_epochs
    if n_epochs == "auto":
        n_epochs = DEFAULT_EPOCHS
        if n_examples * n_epochs < MIN_TARGET_EXAMPLES:
            n_epochs = min(MAX_AUTO_EPOCHS, math.ceil(MIN_TARGET_EXAMPLES / n_examples))
        elif n_examples * n_epochs > MAX_TARGET_EXAMPLES:
            n_epochs = max(1, MAX_TARGET_EXAMPLES // n_examples)
    multiplier = 1.0 if spec.learning_rate_multiplier == "auto" else float(spec.learning_rate_multiplier)
    return Hyperparameters(int(n_epochs), int(batch_size), BASE_LEARNING_RATE[spec.method] * multiplier)


def run_finetune(
    spec: FinetuneSpec, hooks: TrainingHooks | None = None, resume_from: str | None = None
) -> FinetuneResult:
    """Train as `spec` says. `resume_from`: a checkpoint dir of an earlier (paused) run with the same spec."""
    hooks = hooks or TrainingHooks()
    validate_spec(spec)
    if resume_from is not None:
        _check_dir(resume_from, "resume_from")
    tokenizer = _load_tokenizer(spec.model_dir)
    config = ZayaConfig.from_pretrained(spec.model_dir)
    max_seq_len = spec.max_seq_len or config.max_position_embeddings

    train_report = _validated(spec.train_file, "train_file", tokenizer, max_seq_len, spec.validation_file)
    if spec.validation_file is not None:
        _validated(spec.validation_file, "validation_file", tokenizer, max_seq_len, None)
    train_set = TokenizedDataset(read_examples(spec.train_file), tokenizer)
    eval_set = TokenizedDataset(read_examples(spec.validation_file), tokenizer) if spec.validation_file else None
    hyper = resolve_hyperparameters(spec, len(train_set))
    hooks.on_event(
        "info",
        f"dataset valid: {train_report.n_examples} examples, {train_report.n_trained_tokens} trained tokens",
        {
            "n_examples": train_report.n_examples,
            "n_tokens": train_report.n_tokens,
            "n_trained_tokens": train_report.n_trained_tokens,
            "n_epochs": hyper.n_epochs,
            "batch_size": hyper.batch_size,
            "learning_rate": hyper.learning_rate,
        },
    )

    set_seed(spec.seed)  # before the LoRA matrices are initialised
    base = ZayaForCausalLM.from_pretrained(spec.model_dir, dtype=torch.float32)
    base.generation_config.eos_token_id = _stop_token_ids(tokenizer)
    base.generation_config.pad_token_id = tokenizer.pad_token_id
    if spec.compile:
        try:
            base.enable_compiled_layers()
        except RuntimeError as error:
            raise FinetuneError(f"compile: {error}") from None
    fingerprint = base_model_fingerprint(base)
    model = _with_adapter(base, spec) if spec.method == "lora" else base

    stop = HooksCallback(hooks)
    callbacks: list[TrainerCallback] = [stop, NonFiniteLossCallback(), _FinalCheckpointCallback(stop)]
    wall_time = WallTimeCallback(spec.max_seconds, hooks) if spec.max_seconds is not None else None
    if wall_time is not None:
        callbacks.insert(1, wall_time)
    balancing = None
    if spec.method == "full" and spec.balancing_bias_lr > 0:
        balancing = BalancingBiasCallback(model, spec.balancing_bias_lr)
        if resume_from is not None:
            balancing.load(Path(resume_from))
        callbacks.append(balancing)  # runs at every step end, before any checkpoint of that step is saved
    if spec.early_stopping_patience is not None:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=spec.early_stopping_patience))
    trainer = _FinetuneTrainer(
        model=model,
        args=_training_arguments(spec, hyper, has_validation=eval_set is not None),
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=make_collator(tokenizer, spec.packing),
        processing_class=tokenizer,
        compute_metrics=_compute_metrics if eval_set is not None else None,
        preprocess_logits_for_metrics=_logits_to_token_statistics if eval_set is not None else None,
        callbacks=callbacks,
        hooks=hooks,
        fingerprint=fingerprint if spec.method == "lora" else None,
        balancing=balancing,
        keep_checkpoints=spec.keep_checkpoints,
    )
    trainer.remove_callback(PrinterCallback)  # progress goes to the hooks, not to stdout
    if resume_from is not None:
        hooks.on_event("info", f"resuming from {resume_from}", {"path": resume_from})
    if spec.compile:
        hooks.on_event("info", COMPILING_MESSAGE)
    output = trainer.train(resume_from_checkpoint=resume_from)

    metrics = _final_metrics(trainer, output.metrics)
    kind = "adapter" if spec.method == "lora" else "full"
    if stop.stop_reason is not None:
        status = "cancelled" if stop.stop_reason == "cancel" else "paused"
        hooks.on_event("info", f"training {status} at step {trainer.state.global_step}")
        return FinetuneResult(status, None, kind, metrics, trainer.checkpoint_records())

    try:
        result_dir, kind = _write_outputs(spec, trainer, base, tokenizer, fingerprint, metrics)
    except OSError as error:
        raise CheckpointWriteError(f"could not write the fine-tuned model in {spec.output_dir}: {error}") from error
    hooks.on_event("info", f"wrote {kind} to {result_dir}", {"path": str(result_dir)})
    return FinetuneResult("succeeded", str(result_dir), kind, metrics, trainer.checkpoint_records())


def _write_outputs(
    spec: FinetuneSpec, trainer: Trainer, base: ZayaForCausalLM, tokenizer: Any, fingerprint: str, metrics: dict
) -> tuple[Path, str]:
    """output_dir/final (adapter or full checkpoint) and, with merge_adapter, output_dir/merged; each atomic."""
    final_dir, kind = Path(spec.output_dir) / "final", "adapter" if spec.method == "lora" else "full"
    with atomic_directory(final_dir) as staging:
        trainer.model.save_pretrained(staging)
        save_generation_files(staging, base, tokenizer)
        if kind == "adapter":
            write_json_atomic(staging / BASE_MODEL_FILE, {"fingerprint": fingerprint, "model_dir": spec.model_dir})
        write_json_atomic(staging / METRICS_FILE, metrics)
    if not spec.merge_adapter:
        return final_dir, kind
    merged_dir = Path(spec.output_dir) / "merged"
    with atomic_directory(merged_dir) as staging:
        merged = trainer.model.merge_and_unload()
        merged.save_pretrained(staging)
        save_generation_files(staging, merged, tokenizer)
        write_json_atomic(staging / METRICS_FILE, metrics)
    return merged_dir, "full"


class _FinetuneTrainer(Trainer):
    """Trainer whose checkpoints are written atomically, carry metrics.json and are reported to the hooks."""

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
        self.checkpoints: dict[int, dict] = {}
        self._staging_root: str | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # A training step needs only the loss: the LM head then runs on the trained (assistant) positions alone.
        if not return_outputs and "labels" in inputs and self.label_smoother is None and self.compute_loss_func is None:
            inputs = {**inputs, "skip_logits": True}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _get_output_dir(self, trial: Any) -> str:
        return self._staging_root or super()._get_output_dir(trial)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        run_dir = super()._get_output_dir(trial)
        name = f"checkpoint-{self.state.global_step}"
        os.makedirs(run_dir, exist_ok=True)
        self._staging_root = os.path.join(run_dir, f".{name}.partial")
        try:
            super()._save_checkpoint(model, trial)  # writes into the staging root
            staging = Path(self._staging_root) / name
            # The Trainer looked for the best checkpoint in the staging root; point it at the published one.
            best_step = self.state.best_global_step
            best = os.path.join(run_dir, f"checkpoint-{best_step}")
            if best_step and (best_step == self.state.global_step or os.path.isdir(best)):
                self.state.best_model_checkpoint = best
            self.state.save_to_json(str(staging / "trainer_state.json"))
            save_generation_files(staging, self.model, self.processing_class)
            if self.fingerprint:
                write_json_atomic(staging / BASE_MODEL_FILE, {"fingerprint": self.fingerprint})
            if self.balancing is not None:
                self.balancing.save(staging)
            metrics = self._checkpoint_metrics()
            write_json_atomic(staging / METRICS_FILE, metrics)
            publish_directory(staging, Path(run_dir) / name)
        except Exception as error:  # torch, safetensors and json each raise their own type for a full disk
            raise CheckpointWriteError(f"could not write checkpoint {name} in {run_dir}: {error}") from error
        finally:
            shutil.rmtree(self._staging_root, ignore_errors=True)
            self._staging_root = None
        path = os.path.join(run_dir, name)
        self.checkpoints[self.state.global_step] = {"step": self.state.global_step, "path": path, "metrics": metrics}
        self.hooks.on_checkpoint(self.state.global_step, path, metrics)
        if self.keep_checkpoints is not None:
            self._rotate(run_dir)

    def _rotate(self, run_dir: str) -> None:
        """Keep the newest `keep_checkpoints` and the best (which `load_best_model_at_end` reloads at the end)."""
        for step in rotate_checkpoints(run_dir, self.keep_checkpoints, self.state.best_global_step or None):
            record = self.checkpoints.pop(step, None)
            self.hooks.on_checkpoint_deleted(
                step, record["path"] if record else os.path.join(run_dir, f"checkpoint-{step}")
            )

    def _checkpoint_metrics(self) -> dict:
        """OpenAI's checkpoint metrics: step, the latest train loss, the latest validation loss and token accuracy."""
        metrics: dict[str, Any] = {"step": self.state.global_step}
        for entry in self.state.log_history:
            if entry.get("step", 0) <= self.state.global_step:
                metrics.update({k: v for k, v in rename_metrics(entry).items() if k in CHECKPOINT_METRICS})
        return metrics

    def checkpoint_records(self) -> list[dict]:
        return [self.checkpoints[step] for step in sorted(self.checkpoints)]


class _FinalCheckpointCallback(TrainerCallback):
    """One checkpoint, with a fresh evaluation, when training ends early or on a step the schedule would skip.

    With per-epoch evaluation the Trainer evaluates and saves at the end of the (possibly cut) epoch, so the save it
    also asks for at the last step is dropped; with per-step evaluation the last step gets both. A pause saves at
    once and a cancel saves nothing (`HooksCallback` also drops their end-of-epoch evaluation and save).
    """

    def __init__(self, stop: HooksCallback):
        self.stop = stop

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop.stop_reason is not None or not control.should_training_stop:
            return
        if args.save_strategy == "epoch":
            control.should_save = False
        elif state.global_step % args.save_steps != 0:
            control.should_evaluate = args.eval_strategy != "no"
            control.should_save = True


def _training_arguments(spec: FinetuneSpec, hyper: Hyperparameters, has_validation: bool) -> TrainingArguments:
    strategy = "steps" if spec.eval_every else "epoch"
    return TrainingArguments(
        output_dir=os.path.join(spec.output_dir, "checkpoints"),
        per_device_train_batch_size=hyper.batch_size,
        per_device_eval_batch_size=hyper.batch_size,
        num_train_epochs=hyper.n_epochs,
        max_steps=spec.max_steps or -1,
        learning_rate=hyper.learning_rate,
        lr_scheduler_type="linear",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        logging_nan_inf_filter=False,
        eval_strategy=strategy if has_validation else "no",
        eval_steps=spec.eval_every,
        save_strategy=strategy,
        save_steps=spec.eval_every,
        load_best_model_at_end=has_validation,
        metric_for_best_model="valid_loss" if has_validation else None,
        greater_is_better=False if has_validation else None,
        seed=spec.seed,
        data_seed=spec.seed,
        remove_unused_columns=False,
        label_names=["labels"],
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=spec.gradient_checkpointing,
        # Non-reentrant: correct with frozen inputs (LoRA) without forcing the embeddings to require grad.
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )


def _with_adapter(model: ZayaForCausalLM, spec: FinetuneSpec) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = list(spec.lora_target_modules or DEFAULT_LORA_TARGET_MODULES)
    # PEFT ignores an unmatched name when target_parameters match, so check every name here.
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in names)]
    if missing:
        raise FinetuneError(f"lora_target_modules: no module named {', '.join(map(repr, missing))} in this model")
    config = LoraConfig(
        r=spec.lora_r,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.lora_dropout,
        target_modules=targets,
        target_parameters=LORA_EXPERT_PARAMETERS if spec.lora_target_experts else None,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def _logits_to_token_statistics(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Keep (nll, correct) per token instead of the logits: far less memory while evaluating.
    return token_statistics(logits[0] if isinstance(logits, tuple) else logits, labels)


def _compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
    statistics, labels = prediction.predictions, prediction.label_ids
    trained = labels[:, 1:] != IGNORE_INDEX  # the Trainer pads both to the longest batch with -100
    n_trained = max(int(trained.sum()), 1)
    return {
        "valid_loss": float(np.where(trained, statistics[..., 0], 0).sum() / n_trained),
        "valid_mean_token_accuracy": float(np.where(trained, statistics[..., 1], 0).sum() / n_trained),
    }


def _final_metrics(trainer: _FinetuneTrainer, train_output_metrics: dict) -> dict:
    metrics = trainer._checkpoint_metrics()
    metrics["train_runtime"] = train_output_metrics.get("train_runtime")
    metrics["epoch"] = trainer.state.epoch
    if trainer.state.best_metric is not None:
        metrics["best_valid_loss"] = trainer.state.best_metric
        metrics["best_step"] = trainer.state.best_global_step
    return metrics


def _validated(
    path: str, field_name: str, tokenizer: Any, max_seq_len: int, other_path: str | None
) -> ValidationReport:
    report = validate_dataset(
        path, tokenizer=tokenizer, max_seq_len=max_seq_len, other_path=other_path, max_problems=MAX_PROBLEMS_SHOWN
    )
    if not report.is_valid:
        problems = "; ".join(report.problem_lines())
        raise FinetuneError(f"{field_name}: {report.n_problems} problem(s) in {path}: {problems}")
    return report


def _stop_token_ids(tokenizer: Any) -> list[int]:
    try:
        return generation_eos_token_ids(tokenizer)
    except ValueError:  # a tokenizer without a chat end-of-turn token stops on EOS only
        return [tokenizer.eos_token_id]


def _load_tokenizer(model_dir: str) -> Any:
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as error:
        raise FinetuneError(f"model_dir: cannot load a tokenizer from {model_dir}: {error}") from None


def _check_dir(path: Any, name: str) -> None:
    if not isinstance(path, str | os.PathLike) or not os.path.isdir(path):
        raise FinetuneError(f"{name}: directory not found: {path}")


def _check_file(path: Any, name: str) -> None:
    if not isinstance(path, str | os.PathLike) or not os.path.isfile(path):
        raise FinetuneError(f"{name}: file not found: {path}")


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise FinetuneError(f"{name}: must be an integer from {low} to {high}{_or_auto(name)}, got {value!r}")


def _check_number(
    name: str, value: Any, low: float, high: float, *, open_low: bool = False, open_high: bool = False
) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
    if not ok:
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        raise FinetuneError(f"{name}: must be a number in {interval}{_or_auto(name)}, got {value!r}")


def _or_auto(name: str) -> str:
    return ' or "auto"' if name in ("n_epochs", "batch_size", "learning_rate_multiplier") else ""
