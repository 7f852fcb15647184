"""`python -m finetune.demo` (= `make demo`): LoRA fine-tuning on the bank disposition task, before and after.

Starts from the tiny model that `zaya run` bootstraps (`finetune.bootstrap.build_tiny_model`: a tokenizer and a 2-layer
ZAYA pretrained for 100 steps on synthetic bank chats), writes a disposition training set and a held-out set of
fresh synthetic cases (other seeds than the bootstrap corpus), scores the base model on the held-out set, fine-tunes
a LoRA adapter with `run_finetune` and scores base + adapter with `evaluate_model`: held-out loss, token accuracy
and exact-match disposition accuracy, printed as a table (and written as JSON with `--json`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from finetune.datasets.synthetic import generate_chat_examples
from finetune.evaluate import evaluate_model
from finetune.settings import FineTuneSettings
from finetune.train import FineTuneRun, TrainingHooks, run_finetune

TRAIN_SEED, VALID_SEED = 1, 2  # the bootstrap corpus uses seed 0


class _Progress(TrainingHooks):
    def __init__(self, every: int):
        self.every = every

    def on_metrics(self, step: int, metrics: dict) -> None:
        if "train_loss" in metrics and step % self.every == 0:
            print(f"  step {step}: train loss {metrics['train_loss']:.3f}", flush=True)


def run_demo(
    workdir: Path, n_train: int, n_valid: int, steps: int, seed: int, bootstrap_steps: int, lr_multiplier: float
) -> dict:
    from finetune.bootstrap import build_tiny_model  # the model `zaya run` registers: the demo starts where users start

    started = time.monotonic()
    print(f"building zaya run's tiny model ({bootstrap_steps} pretraining steps) ...", flush=True)
    base_dir = build_tiny_model(workdir / "base", train_steps=bootstrap_steps)
    train_file = _write_chats(workdir / "train.jsonl", n_train, TRAIN_SEED)
    valid_file = _write_chats(workdir / "valid.jsonl", n_valid, VALID_SEED)

    print(f"scoring the base model on {n_valid} held-out cases ...", flush=True)
    before = evaluate_model(str(base_dir), str(valid_file))
    print(f"LoRA fine-tuning for {steps} steps on {n_train} disposition chats ...", flush=True)
    settings = FineTuneSettings.from_options(
        method="lora",
        batch_size=4,
        n_epochs=100,  # max_steps ends the run
        max_steps=steps,
        learning_rate_multiplier=lr_multiplier,
        keep_checkpoints=1,
    )
    output_dir = str(workdir / "lora")
    run = FineTuneRun(str(base_dir), str(train_file), output_dir, seed=seed, settings=settings)
    trained = time.monotonic()
    result = run_finetune(run, _Progress(max(1, steps // 10)))
    train_seconds = time.monotonic() - trained
    after = evaluate_model(str(base_dir), str(valid_file), adapter_dir=result.output_dir)
    return {
        "base_model": "zaya run's tiny model (finetune.bootstrap.build_tiny_model)",
        "bootstrap_steps": bootstrap_steps,
        "n_train": n_train,
        "n_valid": n_valid,
        "steps": steps,
        "seed": seed,
        "lora": {"r": settings.lora.r, "alpha": settings.lora.alpha, "batch_size": settings.hyperparameters.batch_size},
        "learning_rate_multiplier": lr_multiplier,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.monotonic() - started, 1),
        "before": before,
        "after": after,
    }


def _write_chats(path: Path, n: int, seed: int) -> Path:
    records = generate_chat_examples(n, seed=seed, tasks=("disposition",))
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def disposition_accuracy(scores: dict) -> float:
    return scores["task_evaluation"]["fields"]["Disposition"]["accuracy"]


def print_table(report: dict) -> None:
    rows = [("model", "loss", "token accuracy", "disposition accuracy")]
    for name, scores in (("base", report["before"]), ("base + LoRA", report["after"])):
        rows.append(
            (
                name,
                f"{scores['loss']:.2f}",
                f"{scores['token_accuracy']:.3f}",
                f"{disposition_accuracy(scores):.3f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if index == 0:
            print("  ".join("-" * width for width in widths))
    print(
        f"{report['n_train']} training chats, {report['steps']} LoRA steps ({report['train_seconds']} s), "
        f"{report['n_valid']} held-out chats"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=240, metavar="N", help="training chats (default 240)")
    parser.add_argument("--valid", type=int, default=30, metavar="N", help="held-out chats (default 30)")
    parser.add_argument("--steps", type=int, default=300, metavar="N", help="LoRA optimizer steps (default 300)")
    parser.add_argument(
        "--learning-rate-multiplier", type=float, default=50.0, metavar="X", help="x LoRA's 2e-4 (default 50)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bootstrap-steps", type=int, default=100, metavar="N", help="as `zaya run` (default 100)")
    parser.add_argument("--workdir", type=Path, help="keep the model, data and adapter here (default: a temp dir)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the report as JSON")
    args = parser.parse_args(argv)
    for name in ("train", "valid", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")

    with tempfile.TemporaryDirectory(prefix="zaya-demo-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        report = run_demo(
            workdir, args.train, args.valid, args.steps, args.seed, args.bootstrap_steps, args.learning_rate_multiplier
        )
    print_table(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
