"""`python -m finetune.demo` (= `make demo`): pretrain, then LoRA fine-tune on the bank disposition task.

The CPU recipe end to end: writes a corpus of synthetic bank case files and disposition chats (`zaya data sample`'s
`finetune.datasets.sample`), pretrains a base model on the corpus with the `cpu` preset (`zaya pretrain --preset
cpu`), scores it on held-out chats, fine-tunes a LoRA adapter with `run_finetune` and every setting left at its
default ("auto" epochs, batch size and learning rate; `--steps` caps the steps), and scores base + adapter with
`evaluate_model`: held-out loss, token accuracy, disposition accuracy and exact match, printed as a table (and written
as JSON with `--json`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from finetune.datasets.sample import write_corpus, write_sample
from finetune.evaluate import evaluate_model
from finetune.run import FineTuneRun, TrainingHooks, run_finetune
from finetune.settings import FineTuneSettings


class _Progress(TrainingHooks):
    def __init__(self) -> None:
        self.resolved: dict[str, Any] = {}

    def on_event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        if data and "n_epochs" in data:
            self.resolved = {key: data[key] for key in ("n_epochs", "batch_size", "learning_rate")}
            print(f"  {message}; chosen: {self.resolved}", flush=True)

    def on_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        if "train_loss" in metrics and step % 50 == 0:
            print(f"  step {step}: train loss {metrics['train_loss']:.3f}", flush=True)


def run_demo(
    workdir: Path, n_corpus: int, pretrain_steps: int | None, n_train: int, n_valid: int, steps: int | None, seed: int
) -> dict[str, Any]:
    from zaya_model.pretrain.presets import get_preset
    from zaya_model.pretrain.train import Pretrainer

    started = time.monotonic()
    settings = get_preset("cpu")
    if pretrain_steps is not None:
        settings = settings.replace(max_steps=pretrain_steps)
    # No step watchdog: the demo runs in terminals and test runners alike (it needs a real stderr file).
    steps_each = settings.max_steps
    settings = settings.replace(eval_every=steps_each, save_every=steps_each, seed=seed, step_timeout_s=0)
    corpus = write_corpus(workdir / "corpus.jsonl", n_corpus)
    print(f"pretraining the cpu preset for {settings.max_steps} steps on {n_corpus} bank case files ...", flush=True)
    base_dir = workdir / "base"
    Pretrainer(str(corpus), str(base_dir), settings, progress=False).train()
    files = write_sample(workdir / "data", n_train, n_validation=n_valid, seed=seed)
    train_file, valid_file = files["train.jsonl"]["path"], files["validation.jsonl"]["path"]

    print(f"scoring the base model on {n_valid} held-out cases ...", flush=True)
    before = evaluate_model(str(base_dir), valid_file)
    print(f"LoRA fine-tuning on {n_train} disposition chats, default settings ...", flush=True)
    options: dict[str, Any] = {"method": "lora", "keep_checkpoints": 1}
    if steps is not None:
        options["max_steps"] = steps
    run = FineTuneRun(
        str(base_dir), train_file, str(workdir / "lora"), seed=seed, settings=FineTuneSettings.from_options(**options)
    )
    progress = _Progress()
    trained = time.monotonic()
    result = run_finetune(run, progress)
    train_seconds = time.monotonic() - trained
    after = evaluate_model(str(base_dir), valid_file, adapter_dir=result.output_dir)
    return {
        "base_model": f"cpu preset, {settings.max_steps} pretraining steps on {n_corpus} case files",
        "pretrain_steps": settings.max_steps,
        "n_train": n_train,
        "n_valid": n_valid,
        "steps": result.metrics.get("step"),
        "seed": seed,
        "hyperparameters": progress.resolved,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.monotonic() - started, 1),
        "before": before,
        "after": after,
    }


def disposition_accuracy(scores: dict[str, Any]) -> float:
    return float(scores["task_evaluation"]["fields"]["Disposition"]["accuracy"])


def print_table(report: dict[str, Any]) -> None:
    rows = [("model", "loss", "token accuracy", "disposition accuracy", "exact match")]
    for name, scores in (("base", report["before"]), ("base + LoRA", report["after"])):
        rows.append(
            (
                name,
                f"{scores['loss']:.2f}",
                f"{scores['token_accuracy']:.3f}",
                f"{disposition_accuracy(scores):.3f}",
                f"{scores['task_evaluation']['exact_match']:.3f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if index == 0:
            print("  ".join("-" * width for width in widths))
    print(
        f"{report['base_model']}; {report['n_train']} training chats, {report['steps']} LoRA steps "
        f"({report['train_seconds']} s, {report['hyperparameters']}), {report['n_valid']} held-out chats"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=int, default=3000, metavar="N", help="pretraining case files (3000)")
    parser.add_argument("--pretrain-steps", type=int, metavar="N", help="instead of the cpu preset's")
    parser.add_argument("--train", type=int, default=600, metavar="N", help="training chats (default 600)")
    parser.add_argument("--valid", type=int, default=30, metavar="N", help="held-out chats (default 30)")
    parser.add_argument("--steps", type=int, metavar="N", help="cap the LoRA optimizer steps (default: auto epochs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="keep the model, data and adapter here (default: a temp dir)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the report as JSON")
    args = parser.parse_args(argv)
    for name in ("corpus", "pretrain_steps", "train", "valid", "steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")

    with tempfile.TemporaryDirectory(prefix="zaya-demo-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        report = run_demo(workdir, args.corpus, args.pretrain_steps, args.train, args.valid, args.steps, args.seed)
    print_table(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
