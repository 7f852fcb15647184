"""`zaya data ...`: validate a fine-tuning dataset, preview an example's loss mask, scan for personal data.

Heavy imports (transformers) happen inside the commands so `zaya --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from server.cli import CommandError


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser(
        "data",
        help="check fine-tuning datasets (JSONL)",
        description="Validate a fine-tuning dataset, preview an example's loss mask, scan for personal data.",
    )
    commands = data.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")

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

    pii = commands.add_parser(
        "pii",
        help="scan for personal data; optionally write a redacted copy",
        description="Count IBANs, card numbers, SSNs, account numbers, e-mails and phone numbers per type.",
    )
    pii.add_argument("file", help="JSONL file")
    pii.add_argument("--redact", metavar="OUT", help="write a copy with typed placeholders such as [IBAN]")
    pii.add_argument("--region", default="US", help="country for phone numbers without a country code")
    pii.add_argument("--json", action="store_true", help="print the report as JSON")
    pii.set_defaults(func=run_pii)


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
    from finetune.datasets.pii import scan_file

    try:
        report = scan_file(_existing(args.file), redact_to=args.redact, default_region=args.region)
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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
