"""Does the CPU recipe learn the bank task? Pretrain, fine-tune with default settings, score base and fine-tunes.

Run: `python -m benchmarks.quality_bench [--smoke] [--out benchmarks/results/quality_bench.json]`

1. `zaya data sample`'s corpus: `--corpus` synthetic closed bank cases (each case file ends with its closing note,
   the disposition and its reason; `--bare-corpus`: without it);
2. `zaya pretrain --preset cpu` on it (a tokenizer, then the model);
3. `zaya data sample`'s chats: `--train` disposition chats and `--valid` held-out ones (other cases);
4. the base model, then a LoRA and a full fine-tune with every setting left at its default ("auto" epochs, batch
   size and learning rate, `finetune.auto`), each scored on the held-out chats by `finetune.evaluate`: teacher-forced
   loss, greedy answers' exact match and their `Disposition` accuracy;
5. each model's disposition on `--threshold-chats` more held-out chats whose only red flag is the sanctions hit, SAR
   and ESCALATE in turn (`generate_threshold_chats`): whether it reads the similarity's 0.90 threshold, which the
   held-out chats test on a dozen cases.

`--copy-start-steps N` and `--copy-rows K` set the pretraining's copying start and copying rows
(`zaya_model/pretrain/copying.py`) instead of the preset's; the report holds the step the start copied from and the
base's final loss on held-out copying rows. `pretrain_tokens` counts the corpus rows' tokens only.

`--variant` words, orders and formats the corpus and the chats differently (`zaya data sample --variant`: ledger,
memo or an integer seed), so the recipe is checked on a wording it was not tuned on.

Prints a table and writes JSON (scores, the hyperparameters the runs resolved, and per phase the wall clock and the
process's CPU seconds). `--smoke` runs every step at toy sizes in seconds (the CI test). Target: pretraining, one
fine-tune and its evaluation within 30 minutes on 2 idle cores. On a machine shared with other jobs the wall clock
says little; the CPU seconds divided by the threads estimate the idle wall clock (`seconds_idle_estimate`: the
threads stay busy through a step, and time spent waiting for a core is not counted).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks import environment

DEFAULT_OUT = environment.default_out("quality_bench")
METHODS = ("lora", "full")
THRESHOLD_SEED = 1_000  # far from the seeds `zaya data sample` gives its chats (1 and 2 + its seed)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextmanager
def timed(report: dict, phase: str) -> Iterator[None]:
    """Record the phase's wall clock, CPU seconds and idle estimate (CPU seconds / threads) in the report."""
    wall, cpu = time.monotonic(), cpu_seconds()
    yield
    report["seconds"][phase] = round(time.monotonic() - wall, 1)
    report["cpu_seconds"][phase] = round(cpu_seconds() - cpu, 1)
    report["seconds_idle_estimate"][phase] = round(report["cpu_seconds"][phase] / report["threads"], 1)


def run(args: argparse.Namespace, workdir: Path) -> dict:
    import torch

    from finetune.datasets.sample import write_sample
    from finetune.evaluate import evaluate_model

    report: dict = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m benchmarks.quality_bench", *sys.argv[1:]]),
        "threads": torch.get_num_threads(),
        "preset": args.preset,
        "corpus_cases": args.corpus,
        "bare_corpus": args.bare_corpus,
        "n_train": args.train,
        "n_valid": args.valid,
        "n_threshold": args.threshold_chats,
        "variant": args.variant,
        "validation_variant": args.validation_variant,
        "seconds": {},
        "cpu_seconds": {},
        "seconds_idle_estimate": {},
        "models": {},
    }
    started, started_cpu = time.monotonic(), cpu_seconds()
    base_dir = prepare_base(args, workdir, report)
    files = write_sample(
        workdir / "data",
        args.train,
        n_validation=args.valid,
        variant=args.variant,
        validation_variant=args.validation_variant,
    )
    train_file, valid_file = files["train.jsonl"]["path"], files["validation.jsonl"]["path"]
    threshold_file = write_threshold_chats(args, workdir / "data" / "threshold.jsonl")
    if not args.skip_base:
        with timed(report, "evaluate_base"):
            report["models"]["base"] = _scores(evaluate_model(base_dir, valid_file))
        with timed(report, "threshold_base"):
            report["models"]["base"]["threshold_accuracy"] = _threshold_accuracy(base_dir, threshold_file)
    for method in args.methods:
        report["models"][method] = finetune_and_evaluate(
            method, args, base_dir, (train_file, valid_file, threshold_file), workdir, report
        )
    report["seconds"]["total"] = round(time.monotonic() - started, 1)
    report["cpu_seconds"]["total"] = round(cpu_seconds() - started_cpu, 1)
    report["seconds_idle_estimate"]["total"] = round(report["cpu_seconds"]["total"] / report["threads"], 1)
    return report


def write_threshold_chats(args: argparse.Namespace, path: Path) -> str:
    """The sanctions-threshold chats, worded as the held-out ones (another seed than the sample's chats)."""
    from finetune.datasets.styles import get_style
    from finetune.datasets.synthetic import generate_threshold_chats
    from zaya_model.training.atomic_io import write_text_atomic

    style = get_style(args.variant)
    held_out_style = style if args.validation_variant is None else get_style(args.validation_variant)
    chats = generate_threshold_chats(
        args.threshold_chats, seed=THRESHOLD_SEED, style=held_out_style, answer_style=style
    )
    write_text_atomic(path, "".join(json.dumps(chat) + "\n" for chat in chats))
    return str(path)


def _threshold_accuracy(model_dir: str, threshold_file: str, adapter_dir: str | None = None) -> float:
    """The greedy answers' disposition accuracy on the threshold chats (no teacher-forced pass: only answers count)."""
    from finetune.evaluate import evaluate_file, load_model

    model, tokenizer = load_model(model_dir, adapter_dir)
    return evaluate_file(model, tokenizer, threshold_file)["fields"]["Disposition"]["accuracy"]


def prepare_base(args: argparse.Namespace, workdir: Path, report: dict) -> str:
    """The base model's directory: `--base`, or pretrained here on the synthetic corpus (recorded in the report)."""
    from finetune.datasets.sample import write_corpus
    from zaya_model.pretrain.presets import get_preset
    from zaya_model.pretrain.train import METRICS_FILE, Pretrainer

    overrides = {
        "max_steps": args.pretrain_steps,
        "tokenizer_split_digits": args.split_digits,
        "copy_start_steps": args.copy_start_steps,
        "copy_rows": args.copy_rows,
        "seed": args.seed,
    }
    settings = get_preset(args.preset).replace(**{key: value for key, value in overrides.items() if value is not None})
    settings = settings.replace(eval_every=settings.max_steps, save_every=settings.max_steps)
    if args.base is not None:  # a base pretrained by an earlier run of this benchmark: its run says how
        base_dir = str(args.base)
        report["base"], report["preset"], report["corpus_cases"] = base_dir, None, None
    else:
        report["pretrain_steps"] = settings.max_steps
        corpus = write_corpus(workdir / "corpus.jsonl", args.corpus, closed=not args.bare_corpus, variant=args.variant)
        with timed(report, "pretrain"):
            pretrainer = Pretrainer(str(corpus), str(workdir / "base"), settings, progress=False)
            pretrained = pretrainer.train()
        report["pretrain_val_loss"] = pretrained.val_loss
        report["copy_start_steps"] = settings.copy_start_steps
        report["copy_rows"] = settings.copy_rows
        report["seed"] = settings.seed
        report |= _copying_report(workdir / "base" / METRICS_FILE)
        report["split_digits"] = settings.tokenizer_split_digits
        corpus_rows = settings.batch_size - settings.copy_rows
        report["pretrain_tokens"] = pretrained.step * corpus_rows * settings.grad_accum * settings.seq_len  # corpus
        report["parameters"] = sum(parameter.numel() for parameter in pretrainer.model.parameters())
        base_dir = str(workdir / "base")
    return base_dir


def _copying_report(metrics_path: Path) -> dict:
    """The copying start's length and the step it copied from, and the final copying loss (`zaya pretrain`'s
    metrics; empty for a run without copying rows)."""
    report: dict = {}
    for line in metrics_path.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "copying_start":
            report["copying_start"] = {key: record[key] for key in ("steps", "copying_from", "copying_loss")}
        elif record.get("event") == "eval" and "copying_loss" in record:
            report["copying_loss"] = record["copying_loss"]
    return report


def finetune_and_evaluate(
    method: str, args: argparse.Namespace, base_dir: str, data: tuple[str, str, str], workdir: Path, report: dict
) -> dict:
    """Fine-tune the base with `method` on the training file of `data` and score the result on its validation and
    threshold files (timed in the report)."""
    from finetune.evaluate import evaluate_model
    from finetune.run import FineTuneRun, run_finetune
    from finetune.settings import FineTuneSettings
    from zaya_model.training.callbacks import TrainingHooks

    class Resolved(TrainingHooks):
        def __init__(self) -> None:
            self.hyperparameters: dict = {}

        def on_event(self, level: str, message: str, data: dict | None = None) -> None:
            if data and "n_epochs" in data:
                self.hyperparameters = {k: data[k] for k in ("n_epochs", "batch_size", "learning_rate")}

    options = {"method": method}
    if args.max_steps is not None:
        options["max_steps"] = args.max_steps
    hooks = Resolved()
    train_file, valid_file, threshold_file = data
    run_config = FineTuneRun(
        base_dir, train_file, str(workdir / method), settings=FineTuneSettings.from_options(**options)
    )
    with timed(report, f"finetune_{method}"):
        result = run_finetune(run_config, hooks)
    if result.output_dir is None:
        raise SystemExit(f"fine-tuning ({method}) ended {result.status}, with no model to evaluate")
    adapter = result.output_dir if method == "lora" else None
    model_dir = base_dir if adapter else result.output_dir
    with timed(report, f"evaluate_{method}"):
        scores = evaluate_model(model_dir, valid_file, adapter_dir=adapter)
    with timed(report, f"threshold_{method}"):
        threshold = _threshold_accuracy(model_dir, threshold_file, adapter)
    return {
        **_scores(scores),
        "threshold_accuracy": threshold,
        "hyperparameters": hooks.hyperparameters,
        "steps": result.metrics.get("step"),
        "train_loss": result.metrics.get("train_loss"),
    }


def _scores(evaluation: dict) -> dict:
    task = evaluation["task_evaluation"]
    return {
        "loss": evaluation["loss"],
        "token_accuracy": evaluation["token_accuracy"],
        "exact_match": task["exact_match"],
        "disposition_accuracy": task["fields"].get("Disposition", {}).get("accuracy"),
    }


def print_table(report: dict) -> None:
    rows = [
        (
            "model",
            "held-out loss",
            "token accuracy",
            "disposition",
            "exact match",
            "sanctions threshold",
            "epochs",
            "batch",
            "lr",
        )
    ]
    for name, scores in report["models"].items():
        hyper = scores.get("hyperparameters", {})
        rows.append(
            (
                name,
                f"{scores['loss']:.3f}",
                f"{scores['token_accuracy']:.3f}",
                f"{scores['disposition_accuracy']:.3f}",
                f"{scores['exact_match']:.3f}",
                f"{scores['threshold_accuracy']:.3f}",
                str(hyper.get("n_epochs", "")),
                str(hyper.get("batch_size", "")),
                f"{hyper['learning_rate']:.2e}" if "learning_rate" in hyper else "",
            )
        )
    print(environment.format_rows(rows))
    seconds = ", ".join(f"{name} {value} s" for name, value in report["seconds"].items())
    idle = ", ".join(f"{name} {value} s" for name, value in report["seconds_idle_estimate"].items())
    copying = ""
    if "copying_start" in report:
        start = report["copying_start"]
        copies = f"copies from step {start['copying_from']}" if start["copying_from"] else "does not copy yet"
        copying += f", copying start of {start['steps']} steps ({copies})"
    if report.get("copy_rows"):  # pretrained here, so its final copying loss is known
        copying += f", {report['copy_rows']} copying rows a batch (copying loss {report['copying_loss']:.3f})"
    if report.get("base"):
        base = f"base {report['base']}"
    else:
        base = (
            f"preset {report['preset']} ({report['pretrain_steps']} steps on {report['corpus_cases']} case files"
            f"{', digits split' if report.get('split_digits') else ''}{copying})"
        )
    print(
        f"{base}, variant {report['variant']}, {report['n_train']} training chats, {report['n_valid']} held-out; "
        f"wall clock: {seconds}; idle estimate (CPU s / {report['threads']} threads): {idle}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes, every step (seconds; the CI test)")
    parser.add_argument("--preset", default="cpu", help="pretraining preset (default cpu)")
    parser.add_argument("--corpus", type=int, default=3000, metavar="N", help="pretraining case files")
    parser.add_argument(
        "--bare-corpus", action="store_true", help="case files without their closing notes (disposition, reason)"
    )
    parser.add_argument("--pretrain-steps", type=int, metavar="N", help="instead of the preset's")
    parser.add_argument(
        "--split-digits",
        action=argparse.BooleanOptionalAction,
        help="the tokenizer writes numbers digit by digit (or not), instead of as the preset says",
    )
    parser.add_argument("--copy-start-steps", type=int, metavar="N", help="copying start's cap (preset's)")
    parser.add_argument("--copy-rows", type=int, metavar="K", help="copying rows per batch (preset's)")
    parser.add_argument("--seed", type=int, metavar="N", help="pretraining seed (preset's)")
    parser.add_argument("--train", type=int, default=600, metavar="N", help="training chats (default 600)")
    parser.add_argument("--valid", type=int, default=60, metavar="N", help="held-out chats (default 60)")
    parser.add_argument(
        "--threshold-chats",
        type=int,
        default=120,
        metavar="N",
        help="held-out chats whose disposition is the sanctions threshold alone (default 120)",
    )
    parser.add_argument("--max-steps", type=int, metavar="N", help="cap each fine-tune's optimizer steps")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--base", type=Path, help="skip pretraining: fine-tune this base (an earlier run's)")
    parser.add_argument(
        "--variant", default="standard", help="zaya data sample's wording: standard, ledger, memo or an integer seed"
    )
    parser.add_argument(
        "--validation-variant", help="held-out case files in this wording (answers worded as the training ones)"
    )
    parser.add_argument("--skip-base", action="store_true", help="do not score the base model")
    parser.add_argument("--workdir", type=Path, help="keep the corpus, models and data here (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON report (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.threshold_chats < 2:
        parser.error("--threshold-chats: at least 2 (SAR and ESCALATE in turn)")
    from finetune.datasets.styles import get_style

    for flag, variant in (("--variant", args.variant), ("--validation-variant", args.validation_variant)):
        if variant is not None:
            try:
                get_style(variant)
            except ValueError as error:
                parser.error(f"{flag}: {error}")
    if args.smoke:
        args.preset, args.corpus, args.pretrain_steps = "cpu", 40, 2
        args.copy_start_steps, args.copy_rows = 2, 1
        args.train, args.valid, args.threshold_chats, args.max_steps = 6, 3, 2, 2

    from zaya_model.training.runtime import prepare_training_process

    # OMP_NUM_THREADS, when set, says how many threads; the processes this one starts inherit the count.
    environment.use_threads(int(os.environ.get("OMP_NUM_THREADS", environment.DEFAULT_THREADS)))
    prepare_training_process()
    with tempfile.TemporaryDirectory(prefix="zaya-quality-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        report = run(args, workdir)
    environment.publish_report(args.out, report, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
