"""The server's narrow door to the fine-tuning core (`finetune.train`): a job's settings become a `FinetuneSpec`.

`finetune.train` imports torch and transformers, so it is imported inside the functions: the API server pays for
it on the first job it validates, `zaya --help` never.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from server.errors import InvalidRequest

LEVELS = {"info": "info", "warning": "warn", "warn": "warn", "error": "error"}


def preload() -> None:
    """Import the fine-tuning core now (seconds: torch, transformers, peft), so a worker's first job starts at once."""
    import finetune.train  # noqa: F401


def build_spec(
    *,
    method: dict[str, Any],
    seed: int,
    model_dir: Path,
    train_file: Path,
    validation_file: Path | None,
    output_dir: Path,
):
    """A `FinetuneSpec` from a job's stored `method` object (see `server.api.routes.fine_tuning.Method`)."""
    from finetune.train import FinetuneSpec

    supervised = method.get("supervised") or {}
    hyper = supervised.get("hyperparameters") or {}
    lora = supervised.get("lora") or {}
    optional = {}
    if hyper.get("balancing_bias_lr") is not None:  # else FinetuneSpec's default
        optional["balancing_bias_lr"] = hyper["balancing_bias_lr"]
    return FinetuneSpec(
        model_dir=str(model_dir),
        train_file=str(train_file),
        validation_file=str(validation_file) if validation_file is not None else None,
        output_dir=str(output_dir),
        method=supervised.get("adapter", "lora"),
        n_epochs=hyper.get("n_epochs", "auto"),
        batch_size=hyper.get("batch_size", "auto"),
        learning_rate_multiplier=hyper.get("learning_rate_multiplier", "auto"),
        lora_r=lora.get("r", 8),
        lora_alpha=lora.get("alpha", 16),
        lora_dropout=lora.get("dropout", 0.0),
        lora_target_modules=lora.get("target_modules"),
        lora_target_experts=lora.get("target_experts", True),
        max_steps=hyper.get("max_steps"),
        max_seconds=hyper.get("max_seconds"),
        eval_every=hyper.get("eval_every"),
        early_stopping_patience=hyper.get("early_stopping_patience"),
        seed=seed,
        max_seq_len=hyper.get("max_seq_len"),
        packing=hyper.get("packing", True),
        merge_adapter=supervised.get("merge_adapter", False),
        keep_checkpoints=hyper.get("keep_checkpoints"),
        gradient_checkpointing=hyper.get("gradient_checkpointing", False),
        compile=hyper.get("compile", False),
        **optional,
    )


def dataset_problems(path: Path, *, model_dir: Path, max_seq_len: int | None, other_path: Path | None) -> list[str]:
    """The fine-tuning validator's line-numbered problems in a job's file, checked as the trainer will check it:
    with the base model's tokenizer (chat template, special tokens) and sequence limit. Empty when valid."""
    from transformers import AutoTokenizer

    from finetune.datasets.validation import validate_dataset
    from zaya_model import ZayaConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    limit = max_seq_len or ZayaConfig.from_pretrained(model_dir).max_position_embeddings
    report = validate_dataset(path, tokenizer=tokenizer, max_seq_len=limit, other_path=other_path, max_problems=10)
    return report.problem_lines()


def check_spec(spec) -> None:
    """The trainer's own checks (ranges, paths), as a 400 naming the field."""
    from finetune.train import FinetuneError, validate_spec

    try:
        validate_spec(spec)
    except FinetuneError as error:
        field = str(error).split(":", 1)[0]
        raise InvalidRequest(f"Invalid fine-tuning settings: {error}", param=field, code="invalid_value") from error


def training_hooks_base() -> type:
    """The trainer's hooks base class, for the worker to subclass."""
    from finetune.train import TrainingHooks

    return TrainingHooks


def is_training_error(error: Exception) -> bool:
    """True for a bad spec or dataset (the job's fault: fail it, do not retry)."""
    from finetune.train import FinetuneError

    return isinstance(error, FinetuneError)


def run(spec, hooks, resume_from: str | None):
    from finetune.train import run_finetune

    return run_finetune(spec, hooks=hooks, resume_from=resume_from)
