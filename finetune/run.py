"""LoRA (PEFT) or full fine-tuning of a ZAYA checkpoint on a chat / prompt-completion / text JSONL dataset.

`run_finetune(run, hooks)` is what `zaya finetune` and the server's job worker call. It checks the run's paths and
the dataset, trains with `transformers.Trainer` (assistant-only loss, packing without cross-example leakage, validation
loss and mean token accuracy every `eval_every` steps, early stopping, best checkpoint kept), and writes:

    output_dir/checkpoints/checkpoint-N/   Trainer checkpoints (weights or adapter, optimizer, RNG, metrics.json)
    output_dir/final/                      the adapter (PeftModel.from_pretrained) or full checkpoint
    output_dir/merged/                     with merge_adapter: the adapter merged into a full checkpoint

Every directory is written under a temporary name and renamed into place. Errors: `FinetuneError` (bad input or
dataset; `field` names it), `CheckpointWriteError` (disk full or unwritable; earlier checkpoints
stay intact), `NonFiniteLossError` (the loss diverged).

Full fine-tuning updates the routers' balancing biases after every optimizer step as pretraining does
(`finetune.balancing_callback`); LoRA leaves them as the base model has them. With `keep_checkpoints` set, only the
newest that many checkpoints and the best by validation loss stay on disk (`zaya_model.training.checkpoint_dirs`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoTokenizer,
    EarlyStoppingCallback,
    EvalPrediction,
    PrinterCallback,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import TrainOutput

from zaya_model import ZayaConfig, ZayaForCausalLM
from zaya_model.cpu.compiled_layers import enable_compiled_layers
from zaya_model.pretrain.tokenizer import chat_template_token_ids
from zaya_model.training.adapter_merge import merge_adapter
from zaya_model.training.atomic_io import atomic_directory, write_json_atomic
from zaya_model.training.callbacks import (
    COMPILING_MESSAGE,
    HooksCallback,
    NonFiniteLossCallback,
    TrainingHooks,
    WallTimeCallback,
)
from zaya_model.training.checkpoint_dirs import CheckpointWriteError

from .artifacts import (
    BASE_MODEL_FILE,
    EVALUATION_FILE,
    METRICS_FILE,
    base_model_fingerprint,
    save_generation_files,
)
from .auto import ResolvedHyperparameters, resolve_hyperparameters
from .balancing_callback import BalancingBiasCallback
from .data import IGNORE_INDEX, TokenizedDataset, make_collator, read_examples, token_statistics
from .datasets.formats import Example
from .datasets.validation import ValidationReport, validate_dataset
from .evaluate import describe, evaluate_file, stop_token_ids
from .settings import DEFAULT_LORA_TARGET_MODULES, DpoSettings, FinetuneError, FineTuneSettings
from .trainer_mixin import CheckpointedTraining, FinalCheckpointCallback, final_metrics

MAX_PROBLEMS_SHOWN = 10
LORA_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

__all__ = [
    "CheckpointWriteError",
    "FineTuneRun",
    "FineTuneSettings",
    "FinetuneError",
    "FinetuneResult",
    "TrainingHooks",
    "check_run",
    "run_finetune",
]


@dataclass(frozen=True)
class FineTuneRun:
    """What a run reads and writes, and how it trains (`settings`: the API's `method` object)."""

    model_dir: str
    train_file: str
    output_dir: str
    validation_file: str | None = None
    seed: int = 0
    settings: FineTuneSettings = field(default_factory=FineTuneSettings)


@dataclass
class FinetuneResult:
    status: str  # "succeeded" | "cancelled" | "paused"
    output_dir: str | None  # the final adapter / full checkpoint (merged one with merge_adapter); None unless succeeded
    kind: str  # "adapter" | "full"
    metrics: dict[str, Any] = field(default_factory=dict)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # each {"step", "path", "metrics": {...}}
    evaluation: dict[str, Any] | None = (
        None  # the task evaluation of the validation file (`finetune.evaluate.TaskScores`)
    )
    # Tokens that carried loss, over every epoch and every resumed attempt (None: resumed from a checkpoint that did
    # not record the count)
    trained_tokens: int | None = None


def check_run(run: FineTuneRun, *, output: bool = True) -> None:
    """Check the paths (the output directory too, unless `output` is False) and what the settings ask of them,
    without loading anything heavy; FinetuneError names the field. (The settings' own values were checked when
    `FineTuneSettings` was built.)"""
    _check_dir(run.model_dir, "model_dir")
    _check_file(run.train_file, "train_file")
    if run.validation_file is not None:
        _check_file(run.validation_file, "validation_file")
    if output and (not isinstance(run.output_dir, str) or not run.output_dir):
        raise FinetuneError("output_dir", "must be a directory path")
    if output and os.path.isfile(run.output_dir):
        raise FinetuneError("output_dir", f"{run.output_dir} is a file")
    if isinstance(run.seed, bool) or not isinstance(run.seed, int) or not 0 <= run.seed < 2**32:
        raise FinetuneError("seed", f"must be an integer in [0, 2**32), got {run.seed!r}")
    run.settings.check_inputs(has_validation_file=run.validation_file is not None)


def check_inputs_and_dataset(run: FineTuneRun) -> tuple[Any, ValidationReport]:
    """The checks of `check_run` but the output directory's, then the datasets validated with the base model's
    tokenizer as the run reads them: the tokenizer and the training file's report. FinetuneError names the field."""
    check_run(run, output=False)
    tokenizer = _load_tokenizer(run.model_dir)
    config = ZayaConfig.from_pretrained(run.model_dir)
    max_seq_len = run.settings.hyperparameters.max_seq_len or config.max_position_embeddings
    train_report = _validated(run.train_file, "train_file", tokenizer, max_seq_len, run.validation_file, run.settings)
    if run.validation_file is not None:
        _validated(run.validation_file, "validation_file", tokenizer, max_seq_len, None, run.settings)
    return tokenizer, train_report


def run_finetune(
    run: FineTuneRun, hooks: TrainingHooks | None = None, resume_from: str | None = None
) -> FinetuneResult:
    """Train as `run` says. `resume_from`: a checkpoint dir of an earlier (paused) run with the same settings."""
    hooks = hooks or TrainingHooks()
    check_run(run)
    if resume_from is not None:
        _check_dir(resume_from, "resume_from")
    tokenizer, train_report = check_inputs_and_dataset(run)
    config = ZayaConfig.from_pretrained(run.model_dir)
    train_examples = read_examples(run.train_file)
    eval_examples = read_examples(run.validation_file) if run.validation_file else None
    resolved = resolve_hyperparameters(run.settings, train_report.n_examples, config)
    _announce_dataset(hooks, train_report, resolved)

    base = _load_base_model(run, tokenizer)
    fingerprint = base_model_fingerprint(base)
    lora_config = make_lora_config(base, run.settings, tokenizer) if run.settings.adapter == "lora" else None
    stop = HooksCallback(hooks)
    balancing = _balancing_callback(run, base, resume_from)
    options = _TrainerOptions(
        callbacks=_training_callbacks(run, hooks, stop, balancing),
        hooks=hooks,
        fingerprint=fingerprint if lora_config is not None else None,
        balancing=balancing,
        keep_checkpoints=run.settings.hyperparameters.keep_checkpoints,
    )
    max_seq_len = run.settings.hyperparameters.max_seq_len or config.max_position_embeddings
    trainer = _make_trainer(
        run, base, lora_config, tokenizer, resolved, max_seq_len, train_examples, eval_examples, options
    )
    output = _train(trainer, run, hooks, resume_from)

    metrics = final_metrics(trainer, output.metrics)
    if stop.stop_reason is not None:
        return _stopped_result(trainer, stop.stop_reason, _output_kind(run.settings), metrics, hooks)
    evaluation = None
    if run.validation_file is not None and eval_examples is not None:
        evaluation = _task_evaluation(trainer, tokenizer, run.validation_file, len(eval_examples), hooks)
    result_dir, kind = _write_outputs(run, trainer, base, tokenizer, fingerprint, metrics, evaluation)
    return _succeeded_result(trainer, result_dir, kind, metrics, evaluation, hooks)


def _announce_dataset(hooks: TrainingHooks, report: ValidationReport, resolved: ResolvedHyperparameters) -> None:
    hooks.on_event(
        "info",
        f"dataset valid: {report.n_examples} examples, {report.n_trained_tokens} trained tokens; "
        f"{resolved.n_epochs} epochs, batch size {resolved.batch_size}, learning rate {resolved.learning_rate:.3g}",
        {
            "n_examples": report.n_examples,
            "n_tokens": report.n_tokens,
            "n_trained_tokens": report.n_trained_tokens,
            **resolved.to_dict(),
        },
    )


def _load_base_model(run: FineTuneRun, tokenizer: Any) -> ZayaForCausalLM:
    """The model to train, in fp32, with the run's seed set (before the LoRA matrices are initialised)."""
    set_seed(run.seed)
    base = ZayaForCausalLM.from_pretrained(run.model_dir, dtype=torch.float32)
    base.generation_config.eos_token_id = stop_token_ids(tokenizer)
    base.generation_config.pad_token_id = tokenizer.pad_token_id
    if run.settings.hyperparameters.compile:
        try:
            enable_compiled_layers(base)
        except RuntimeError as error:
            raise FinetuneError(run.settings.setting("hyperparameters", "compile"), str(error)) from None
    return base


def _balancing_callback(
    run: FineTuneRun, base: ZayaForCausalLM, resume_from: str | None
) -> BalancingBiasCallback | None:
    """Full fine-tuning's router balancing-bias updates (continued from `resume_from`'s biases); None for LoRA."""
    bias_lr = run.settings.hyperparameters.balancing_bias_lr
    if run.settings.adapter == "lora" or bias_lr <= 0:
        return None
    balancing = BalancingBiasCallback(base, bias_lr)
    if resume_from is not None:
        balancing.load(Path(resume_from))
    return balancing


def _training_callbacks(
    run: FineTuneRun, hooks: TrainingHooks, stop: HooksCallback, balancing: BalancingBiasCallback | None
) -> list[TrainerCallback]:
    hyperparameters = run.settings.hyperparameters
    callbacks: list[TrainerCallback] = [stop, NonFiniteLossCallback(), FinalCheckpointCallback(stop)]
    if hyperparameters.max_seconds is not None:
        callbacks.insert(1, WallTimeCallback(hyperparameters.max_seconds, hooks))
    if balancing is not None:
        callbacks.append(balancing)  # runs at every step end, before any checkpoint of that step is saved
    if hyperparameters.early_stopping_patience is not None:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=hyperparameters.early_stopping_patience))
    return callbacks


class _TrainerOptions(TypedDict):
    """The keywords every run's trainer takes besides the model and the data: `Trainer`'s callbacks, then
    `CheckpointedTraining`'s own."""

    callbacks: list[TrainerCallback]
    hooks: TrainingHooks
    fingerprint: str | None
    balancing: BalancingBiasCallback | None
    keep_checkpoints: int | None


def _make_trainer(
    run: FineTuneRun,
    base: ZayaForCausalLM,
    lora_config: LoraConfig | None,
    tokenizer: Any,
    resolved: ResolvedHyperparameters,
    max_seq_len: int,
    train_examples: list[Example],
    eval_examples: list[Example] | None,
    options: _TrainerOptions,
) -> CheckpointedTraining:
    """A DPO trainer for a dpo run, else a supervised one (on a LoRA adapter when `lora_config` is given)."""
    arguments = _training_arguments(run, resolved, has_validation=eval_examples is not None)
    method = run.settings.method
    if isinstance(method, DpoSettings):
        from .preference import preference_trainer  # TRL: only preference runs import it

        return preference_trainer(
            model=base,
            lora_config=lora_config,
            reference_dir=run.model_dir,
            arguments=arguments,
            beta=cast(float, resolved.beta),  # resolved for every dpo run
            max_length=max_seq_len,
            train_examples=train_examples,
            eval_examples=eval_examples,
            tokenizer=tokenizer,
            **options,
        )
    has_validation = eval_examples is not None
    return _SupervisedTrainer(
        model=get_peft_model(base, lora_config) if lora_config is not None else base,
        args=TrainingArguments(**arguments, label_names=["labels"]),
        train_dataset=TokenizedDataset(train_examples, tokenizer),
        eval_dataset=TokenizedDataset(eval_examples, tokenizer) if eval_examples is not None else None,
        data_collator=make_collator(tokenizer, method.hyperparameters.packing),
        processing_class=tokenizer,
        compute_metrics=_compute_metrics if has_validation else None,
        preprocess_logits_for_metrics=_logits_to_token_statistics if has_validation else None,
        **options,
    )


def _train(
    trainer: CheckpointedTraining, run: FineTuneRun, hooks: TrainingHooks, resume_from: str | None
) -> TrainOutput:
    """Train, from `resume_from` when given."""
    trainer.remove_callback(PrinterCallback)  # progress goes to the hooks, not to stdout
    if resume_from is not None:
        hooks.on_event("info", f"resuming from {resume_from}", {"path": resume_from})
        trainer.resume_trained_tokens(resume_from)
    if run.settings.hyperparameters.compile:
        hooks.on_event("info", COMPILING_MESSAGE)
    return trainer.train(resume_from_checkpoint=resume_from)


def _stopped_result(
    trainer: CheckpointedTraining, stop_reason: str, kind: str, metrics: dict[str, Any], hooks: TrainingHooks
) -> FinetuneResult:
    """A cancelled or paused run: its checkpoints, no final model."""
    status = "cancelled" if stop_reason == "cancel" else "paused"
    hooks.on_event("info", f"training {status} at step {trainer.state.global_step}")
    return FinetuneResult(
        status, None, kind, metrics, trainer.checkpoint_records(), trained_tokens=trainer.trained_tokens
    )


def _task_evaluation(
    trainer: CheckpointedTraining, tokenizer: Any, validation_file: str, n_examples: int, hooks: TrainingHooks
) -> dict[str, Any]:
    hooks.on_event("info", f"task evaluation: answering the {n_examples} validation examples (greedy)")
    evaluation = evaluate_file(trainer.model, tokenizer, validation_file)
    hooks.on_event("info", f"task evaluation: {describe(evaluation)}", {"task_evaluation": evaluation})
    return evaluation


def _succeeded_result(
    trainer: CheckpointedTraining,
    result_dir: Path,
    kind: str,
    metrics: dict[str, Any],
    evaluation: dict[str, Any] | None,
    hooks: TrainingHooks,
) -> FinetuneResult:
    """A run that trained to its end: the model it wrote, its checkpoints and scores."""
    hooks.on_event("info", f"wrote {kind} to {result_dir}", {"path": str(result_dir)})
    return FinetuneResult(
        "succeeded",
        str(result_dir),
        kind,
        metrics,
        trainer.checkpoint_records(),
        evaluation=evaluation,
        trained_tokens=trainer.trained_tokens,
    )


def _write_outputs(
    run: FineTuneRun,
    trainer: CheckpointedTraining,
    base: ZayaForCausalLM,
    tokenizer: Any,
    fingerprint: str,
    metrics: dict[str, Any],
    evaluation: dict[str, Any] | None,
) -> tuple[Path, str]:
    """output_dir/final (adapter or full checkpoint) and, with merge_adapter, output_dir/merged; each atomic, each
    with the run's metrics and task evaluation. Returns the run's result: the merged model if any, else the final
    one, and its kind. Data-parallel: every process holds the same model; the first writes it, the others wait."""
    final_dir, kind = Path(run.output_dir) / "final", _output_kind(run.settings)
    merged_dir = Path(run.output_dir) / "merged" if run.settings.method.merge_adapter else None
    try:
        if trainer.is_world_process_zero():
            with atomic_directory(final_dir) as staging:
                trainer.trained_model.save_pretrained(str(staging))  # PEFT takes the directory as a str
                save_generation_files(staging, base, tokenizer)
                if kind == "adapter":
                    write_json_atomic(
                        staging / BASE_MODEL_FILE, {"fingerprint": fingerprint, "model_dir": run.model_dir}
                    )
                _write_scores(staging, metrics, evaluation)
            if merged_dir is not None:
                with atomic_directory(merged_dir) as staging:
                    merged = merge_adapter(trainer.model)
                    merged.save_pretrained(staging)
                    save_generation_files(staging, merged, tokenizer)
                    _write_scores(staging, metrics, evaluation)
    except OSError as error:
        raise CheckpointWriteError(f"could not write the fine-tuned model in {run.output_dir}: {error}") from error
    trainer.accelerator.wait_for_everyone()
    return (merged_dir, "full") if merged_dir is not None else (final_dir, kind)


def _output_kind(settings: FineTuneSettings) -> str:
    """What a run trains and writes to final/: "adapter" (LoRA) or "full"."""
    return "adapter" if settings.adapter == "lora" else "full"


def _write_scores(directory: Path, metrics: dict[str, Any], evaluation: dict[str, Any] | None) -> None:
    write_json_atomic(directory / METRICS_FILE, metrics)
    if evaluation is not None:
        write_json_atomic(directory / EVALUATION_FILE, evaluation)


class _SupervisedTrainer(CheckpointedTraining):
    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        # A training step needs only the loss: the LM head then runs on the trained (assistant) positions alone.
        if not return_outputs and "labels" in inputs and self.label_smoother is None and self.compute_loss_func is None:
            inputs = {**inputs, "skip_logits": True}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _training_arguments(run: FineTuneRun, resolved: ResolvedHyperparameters, has_validation: bool) -> dict[str, Any]:
    """The `TrainingArguments` every run uses (a preference run's `DPOConfig` adds its own)."""
    hyperparameters = run.settings.hyperparameters
    strategy = "steps" if hyperparameters.eval_every else "epoch"
    # Data-parallel (`torchrun`): the batch is all processes' together, each takes an equal share.
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if resolved.batch_size % processes:
        message = f"{resolved.batch_size} does not split evenly over {processes} data-parallel processes"
        raise FinetuneError(run.settings.setting("hyperparameters", "batch_size"), message)
    distributed: dict[str, Any] = {}
    if processes > 1 and not torch.cuda.is_available():
        distributed["ddp_backend"] = "gloo"
    if processes > 1 and run.settings.data_parallelism == "FSDP2":  # one decoder layer per unit
        distributed["fsdp"] = "full_shard auto_wrap"
        distributed["fsdp_config"] = {"version": 2, "transformer_layer_cls_to_wrap": ["ZayaDecoderLayer"]}
    return dict(
        output_dir=os.path.join(run.output_dir, "checkpoints"),
        per_device_train_batch_size=resolved.batch_size // processes,
        per_device_eval_batch_size=resolved.batch_size // processes,
        **distributed,
        num_train_epochs=resolved.n_epochs,
        max_steps=hyperparameters.max_steps or -1,
        learning_rate=resolved.learning_rate,
        lr_scheduler_type="linear",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        logging_nan_inf_filter=False,
        eval_strategy=strategy if has_validation else "no",
        eval_steps=hyperparameters.eval_every,
        save_strategy=strategy,
        save_steps=hyperparameters.eval_every,
        load_best_model_at_end=has_validation,
        metric_for_best_model="valid_loss" if has_validation else None,
        greater_is_better=False if has_validation else None,
        seed=run.seed,
        data_seed=run.seed,
        remove_unused_columns=False,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=hyperparameters.gradient_checkpointing,
        # Non-reentrant: correct with frozen inputs (LoRA) without forcing the embeddings to require grad.
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )


def make_lora_config(model: ZayaForCausalLM, settings: FineTuneSettings, tokenizer: Any) -> LoraConfig:
    """PEFT's config for the run's LoRA: the target modules (checked against the model), the fused experts and the
    chat template's token rows (tied to the LM head) as the settings ask."""
    lora = settings.lora
    targets = list(lora.target_modules or DEFAULT_LORA_TARGET_MODULES)
    # PEFT ignores an unmatched name when target_parameters match, so check every name here.
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in names)]
    if missing:
        message = f"no module named {', '.join(map(repr, missing))} in this model"
        raise FinetuneError(settings.setting("lora", "target_modules"), message)
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # PEFT annotates it int; any number works (alpha / r)
        lora_dropout=lora.dropout,
        target_modules=targets,
        target_parameters=LORA_EXPERT_PARAMETERS if lora.target_experts else None,
        trainable_token_indices=_template_token_rows(tokenizer) if lora.trains_template_tokens else None,
        task_type="CAUSAL_LM",
    )


def _template_token_rows(tokenizer: Any) -> dict[str, list[int]] | None:
    token_ids = chat_template_token_ids(tokenizer)
    return {"embed_tokens": token_ids} if token_ids else None


def _logits_to_token_statistics(logits: torch.Tensor | tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
    # Keep (nll, correct) per token instead of the logits: far less memory while evaluating.
    return token_statistics(logits[0] if isinstance(logits, tuple) else logits, labels)


def _compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
    statistics, labels = prediction.predictions, prediction.label_ids
    if isinstance(statistics, tuple) or isinstance(labels, tuple):  # one each: the statistics and the "labels"
        raise TypeError("expected one array of token statistics and one of labels")
    trained = labels[:, 1:] != IGNORE_INDEX  # the Trainer pads both to the longest batch with -100
    n_trained = max(int(trained.sum()), 1)
    return {
        "valid_loss": float(np.where(trained, statistics[..., 0], 0).sum() / n_trained),
        "valid_mean_token_accuracy": float(np.where(trained, statistics[..., 1], 0).sum() / n_trained),
    }


def _validated(
    path: str,
    field_name: str,
    tokenizer: Any,
    max_seq_len: int,
    other_path: str | None,
    settings: FineTuneSettings,
) -> ValidationReport:
    """The file's validation report; FinetuneError when it has problems or is not in a format the run can use."""
    report = validate_dataset(
        path, tokenizer=tokenizer, max_seq_len=max_seq_len, other_path=other_path, max_problems=MAX_PROBLEMS_SHOWN
    )
    if not report.is_valid:
        problems = "; ".join(report.problem_lines())
        raise FinetuneError(field_name, f"{report.n_problems} problem(s) in {path}: {problems}")
    problem = settings.dataset_format_problem(report.format)
    if problem:
        raise FinetuneError(field_name, f"{path}: {problem}")
    return report


def _load_tokenizer(model_dir: str) -> Any:
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as error:
        raise FinetuneError("model_dir", f"cannot load a tokenizer from {model_dir}: {error}") from None


def _check_dir(path: Any, name: str) -> None:
    if not isinstance(path, str | os.PathLike) or not os.path.isdir(path):
        raise FinetuneError(name, f"directory not found: {path}")


def _check_file(path: Any, name: str) -> None:
    if not isinstance(path, str | os.PathLike) or not os.path.isfile(path):
        raise FinetuneError(name, f"file not found: {path}")
