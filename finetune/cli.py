"""`zaya data ...` (validate a dataset, preview an example's loss mask, scan for personal data), `zaya finetune`
(LoRA or full fine-tuning with a progress bar) and `zaya evaluate` (held-out scores as a table and JSON).

Heavy imports (transformers) happen inside the commands so `zaya --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from command_line import CommandError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    data = subparsers.add_parser(
        "data",
        help="check fine-tuning datasets (JSONL)",
        description="Validate a fine-tuning dataset, preview an example's loss mask, scan for personal data.",
    )
    commands = data.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    _register_data_validate(commands)
    _register_data_preview(commands)
    _register_data_pii(commands)
    _register_data_sample(commands)
    _register_finetune(subparsers)
    _register_evaluate(subparsers)


def _register_data_validate(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    validate = commands.add_parser(
        "validate",
        help="validate a dataset; exit 1 with one line per problem",
        description="Validate a JSONL dataset (chat, prompt/completion or text). Exit 0 when valid, else 1.",
    )
    validate.add_argument("file", help="training (or any) JSONL file")
    validate.add_argument("--validation", metavar="FILE", help="validation file (also checked for overlap)")
    validate.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory: enables token counts and checks")
    validate.add_argument("--max-seq-len", type=_positive_int, metavar="N", help="longest example in tokens")
    validate.add_argument("--max-problems", type=_positive_int, default=100, metavar="N", help="problems listed")
    validate.add_argument("--json", action="store_true", help="print the reports as JSON")
    validate.set_defaults(func=run_validate)


def _register_data_preview(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    preview = commands.add_parser(
        "preview",
        help="show one example as the model sees it, with trained tokens marked",
        description="Render the example on --line with the chat template and mark the trained tokens.",
    )
    preview.add_argument("file", help="JSONL file")
    preview.add_argument("--tokenizer", required=True, metavar="DIR", help="tokenizer directory")
    preview.add_argument("--line", required=True, type=_positive_int, metavar="N", help="1-based line number")
    preview.add_argument("--json", action="store_true", help="print tokens and segments as JSON")
    preview.set_defaults(func=run_preview)


def _register_data_pii(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pii = commands.add_parser(
        "pii",
        help="scan for personal data; optionally write a redacted copy",
        description="Count IBANs, card numbers, SSNs, account numbers, e-mails and phone numbers per type "
        "(and person names with --person-model).",
    )
    pii.add_argument("file", help="JSONL file")
    pii.add_argument("--redact", metavar="OUT", help="write a copy with typed placeholders such as [IBAN]")
    pii.add_argument("--region", default="US", help="country for phone numbers without a country code")
    pii.add_argument(
        "--person-model",
        metavar="SPACY_PIPELINE",
        help="also find person names with this installed spaCy pipeline (name or directory; extra `pii`)",
    )
    pii.add_argument("--json", action="store_true", help="print the report as JSON")
    pii.set_defaults(func=run_pii)


def _register_data_sample(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sample = commands.add_parser(
        "sample",
        help="write a sample chat dataset (and optionally a pretraining corpus) of synthetic bank cases",
        description="Write OUTPUT/train.jsonl (--cases disposition chats) and OUTPUT/validation.jsonl (10%%, at "
        "least 3, at most 200, other cases) from the synthetic bank-case generator: each answer is "
        "'Disposition: CLOSE|ESCALATE|SAR' then 'Reason: ...' from the case's numbers. --corpus N also writes "
        "OUTPUT/corpus.jsonl for `zaya pretrain --data`: N closed case files, each ending with its closing note "
        "(disposition and reason; --bare-corpus: without it).",
    )
    sample.add_argument("--cases", type=_positive_int, default=600, metavar="N", help="training chats (default 600)")
    sample.add_argument("--output", required=True, metavar="DIR", help="directory to write the files into")
    sample.add_argument("--validation-cases", type=_positive_int, metavar="N", help="held-out chats (default 10%%)")
    sample.add_argument("--corpus", type=_positive_int, metavar="N", help="also write N case files for pretraining")
    sample.add_argument("--bare-corpus", action="store_true", help="corpus case files without their closing notes")
    sample.add_argument("--seed", type=int, default=0, help="same seed, same files")
    sample.add_argument(
        "--variant",
        default="standard",
        type=_variant,
        metavar="NAME|SEED",
        help="wording, field order and number formats of the case files and answers: standard, ledger, memo, or an "
        "integer seed that draws each at random (default standard)",
    )
    sample.add_argument(
        "--validation-variant",
        type=_variant,
        metavar="NAME|SEED",
        help="write the held-out case files in this variant instead, their answers worded as the training ones",
    )
    sample.set_defaults(func=run_sample)


def _register_finetune(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from finetune.settings import add_settings_flags

    finetune = subparsers.add_parser(
        "finetune",
        help="fine-tune a checkpoint on a JSONL dataset (LoRA or full, supervised or DPO)",
        description="Fine-tune a ZAYA checkpoint. Writes OUTPUT/final (adapter or full checkpoint), "
        "OUTPUT/checkpoints/ and, with --merge-adapter, OUTPUT/merged. The settings are the API's `method` "
        "object, flag for flag; numbers accept 'auto'.",
    )
    finetune.add_argument("--model", required=True, metavar="DIR", help="base checkpoint (with its tokenizer)")
    finetune.add_argument("--train", required=True, metavar="FILE", help="training JSONL")
    finetune.add_argument("--validation", metavar="FILE", help="validation JSONL (loss, token accuracy, best model)")
    finetune.add_argument("--output", metavar="DIR", help="output directory (required unless --dry-run)")
    finetune.add_argument("--resume", metavar="CHECKPOINT", help="continue a paused run from its checkpoint dir")
    finetune.add_argument("--seed", type=int, default=0)
    finetune.add_argument(
        "--dry-run",
        action="store_true",
        help="train nothing: check the inputs, print the trained tokens (per epoch x epochs, 'auto' resolved) and "
        "the training time at the throughput of a few timed forward/backward passes of the model, then JSON",
    )
    finetune.add_argument(
        "--no-measure", dest="measure", action="store_false", help="with --dry-run: count tokens, time nothing"
    )
    add_settings_flags(finetune)
    finetune.set_defaults(func=run_finetune_command)


def _register_evaluate(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    evaluate = subparsers.add_parser(
        "evaluate",
        help="score a model on a held-out JSONL file",
        description="Held-out loss and token accuracy on the trained tokens, and the task evaluation: greedy "
        "answers to each held-out prompt (stopping at the end of the turn), their exact match with the reference "
        "and, for references made of `Field: value` lines, each field's accuracy.",
    )
    evaluate.add_argument("--model", required=True, metavar="DIR", help="base or full checkpoint")
    evaluate.add_argument("--adapter", metavar="DIR", help="LoRA adapter trained on --model")
    evaluate.add_argument("--data", required=True, metavar="FILE", help="held-out JSONL")
    evaluate.add_argument("--json", action="store_true", help="print only the JSON")
    evaluate.set_defaults(func=run_evaluate_command)


def run_finetune_command(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    from command_line.flags import FlagError
    from finetune.run import CheckpointWriteError, FinetuneError, FineTuneRun, run_finetune
    from finetune.settings import settings_from_flags
    from zaya_model.training.callbacks import NonFiniteLossError, ProgressBarHooks
    from zaya_model.training.runtime import prepare_training_process

    try:
        settings = settings_from_flags(args)
    except FlagError as error:
        raise CommandError(str(error)) from None
    if args.output is None and not args.dry_run:
        raise CommandError("--output: required (unless --dry-run)")
    if not args.measure and not args.dry_run:
        raise CommandError("--no-measure: only applies with --dry-run")
    transformers_logging.disable_progress_bar()  # one bar, ours, instead of one per weight load and save
    prepare_training_process()  # this process only trains

    run = FineTuneRun(
        model_dir=args.model,
        train_file=args.train,
        validation_file=args.validation,
        output_dir=args.output or "",
        seed=args.seed,
        settings=settings,
    )
    if args.dry_run:
        return _dry_run(run, measure=args.measure)
    hooks = ProgressBarHooks()
    try:
        result = run_finetune(run, hooks, resume_from=args.resume)
    except FinetuneError as error:
        raise CommandError(_named_by_flag(error)) from None
    except (CheckpointWriteError, NonFiniteLossError) as error:
        raise CommandError(str(error)) from None
    finally:
        hooks.close()
    metrics = ", ".join(f"{key} {value:.4g}" for key, value in result.metrics.items() if isinstance(value, float))
    tokens = "unknown" if result.trained_tokens is None else f"{result.trained_tokens:,}"
    print(f"{result.status}: {result.kind} in {result.output_dir} ({metrics}); trained tokens {tokens}")
    return 0


def _dry_run(run: Any, measure: bool) -> int:
    from finetune.estimate import estimate_run
    from finetune.run import FinetuneError

    try:
        estimate = estimate_run(run, measure=measure)
    except FinetuneError as error:
        raise CommandError(_named_by_flag(error)) from None
    for line in estimate.lines():
        print(f"dry run: {line}")
    print(json.dumps(estimate.to_dict()))
    return 0


# The run's own fields, as `zaya finetune` names them.
_RUN_FLAGS = {
    "model_dir": "--model",
    "train_file": "--train",
    "validation_file": "--validation",
    "output_dir": "--output",
    "resume_from": "--resume",
    "seed": "--seed",
}


def _named_by_flag(error: Any) -> str:
    """A FinetuneError's message under the flag that sets its field."""
    from finetune.settings import cli_flags

    flag = _RUN_FLAGS.get(error.field)
    for candidate in cli_flags():
        if error.field == ".".join(("method", *candidate.path)):
            flag = candidate.option
    return f"{flag}: {error.reason}" if flag else str(error)


def run_evaluate_command(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    from finetune.evaluate import EvaluationError, evaluate_model

    transformers_logging.disable_progress_bar()

    try:
        scores = evaluate_model(args.model, _existing(args.data), adapter_dir=args.adapter)
    except EvaluationError as error:
        raise CommandError(str(error)) from None
    if not args.json:
        for name, value in _table_rows(scores):
            shown = "n/a" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)
            print(f"{name:<32}{shown:>12}")
    print(json.dumps(scores))
    return 0


def _table_rows(scores: dict[str, Any]) -> list[tuple[str, Any]]:
    task = scores["task_evaluation"]
    rows = [(name, value) for name, value in scores.items() if name != "task_evaluation"]
    rows += [("task_examples", task["n_examples"]), ("exact_match", task["exact_match"])]
    rows += [(f"{name} accuracy", field["accuracy"]) for name, field in task["fields"].items()]
    return rows


def run_validate(args: argparse.Namespace) -> int:
    from finetune.datasets.validation import validate_dataset

    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    if args.max_seq_len is not None and tokenizer is None:
        raise CommandError("--max-seq-len needs --tokenizer (lengths are counted in tokens after templating)")
    options = {"tokenizer": tokenizer, "max_seq_len": args.max_seq_len, "max_problems": args.max_problems}
    validation_file = _existing(args.validation) if args.validation else None
    reports = {"training": validate_dataset(_existing(args.file), other_path=validation_file, **options)}
    if validation_file:
        reports["validation"] = validate_dataset(validation_file, **options)

    if args.json:
        print(json.dumps({name: report.to_dict() for name, report in reports.items()}, indent=2))
    else:
        for report in reports.values():
            for line in report.problem_lines():
                print(f"{report.path}: {line}")
            print(_summary(report))
    return 0 if all(report.is_valid for report in reports.values()) else 1


def run_sample(args: argparse.Namespace) -> int:
    from finetune.datasets.sample import CORPUS_FILE, write_corpus, write_sample

    if os.path.isfile(args.output):
        raise CommandError(f"--output: {args.output} is a file")
    written = write_sample(
        args.output,
        args.cases,
        n_validation=args.validation_cases,
        seed=args.seed,
        variant=args.variant,
        validation_variant=args.validation_variant,
    )
    for info in written.values():
        print(f"wrote {info['n_examples']} chats to {info['path']}")
    if args.corpus:
        corpus_path = os.path.join(args.output, CORPUS_FILE)
        path = write_corpus(corpus_path, args.corpus, closed=not args.bare_corpus, variant=args.variant)
        print(f"wrote {args.corpus} case files to {path}")
    return 0


def run_preview(args: argparse.Namespace) -> int:
    from finetune.datasets.preview import preview_line
    from finetune.datasets.rendering import TemplateError

    tokenizer = _load_tokenizer(args.tokenizer)
    try:
        preview = preview_line(_existing(args.file), args.line, tokenizer)
    except (ValueError, TemplateError) as error:
        raise CommandError(str(error)) from None
    print(json.dumps(preview.to_dict(), indent=2, ensure_ascii=False) if args.json else preview.to_text())
    return 0


def run_pii(args: argparse.Namespace) -> int:
    from finetune.datasets.person_names import PersonModelError
    from finetune.datasets.pii import scan_file

    try:
        report = scan_file(
            _existing(args.file), redact_to=args.redact, default_region=args.region, person_model=args.person_model
        )
    except PersonModelError as error:
        raise CommandError(f"--person-model: {error}") from None
    except OSError as error:
        raise CommandError(f"cannot write the redacted copy: {error}") from None
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    for pii_type, count in report.counts.items():
        lines = ", ".join(map(str, report.example_lines[pii_type]))
        print(f"{pii_type}: {count}" + (f" (lines {lines})" if count else ""))
    for pii_type, reason in report.not_scanned.items():
        print(f"{pii_type}: not scanned: {reason}")
    print(f"{report.total} matches on {report.n_lines_with_pii} of {report.n_lines} lines")
    if report.redacted_path:
        print(f"redacted copy: {report.redacted_path}")
    return 0


def _summary(report: Any) -> str:
    status = "valid" if report.is_valid else f"{report.n_problems} problems"
    parts = [f"{report.path}: {status}", f"{report.n_examples} well-formed examples in {report.n_lines} lines"]
    if report.format:
        parts.append(f"format {report.format}")
    if report.n_tokens is not None:
        parts.append(f"{report.n_tokens} tokens, {report.n_trained_tokens} trained")
        parts.append(f"longest {report.max_example_tokens}")
    histogram = ", ".join(f"{bucket.min}-{bucket.max}: {bucket.count}" for bucket in report.length_histogram)
    if histogram:
        parts.append(f"lengths in {report.length_unit}: {histogram}")
    return "; ".join(parts)


def _load_tokenizer(directory: str) -> Any:
    from transformers import AutoTokenizer

    if not os.path.isdir(directory):
        raise CommandError(f"tokenizer directory not found: {directory}")
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as error:
        raise CommandError(f"cannot load a tokenizer from {directory}: {error}") from None


def _existing(path: str) -> str:
    if not os.path.isfile(path):
        raise CommandError(f"file not found: {path}")
    return path


def _variant(text: str) -> str:
    from finetune.datasets.styles import get_style

    try:
        get_style(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
