"""Validate a JSONL fine-tuning dataset in one streaming pass; the same code runs in the CLI, at upload, at job start.

Memory stays flat in the file size except for one 16-byte hash per example (duplicate and overlap detection).
Problems carry 1-based line numbers; listing stops after `max_problems`, the rest are only counted.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .formats import DatasetFormat, Example, FieldProblem, parse_record
from .rendering import TemplateError, TokenizedExample, tokenize_example

if TYPE_CHECKING:  # transformers is slow to import; only the type is needed here
    from transformers import PreTrainedTokenizerBase

DEFAULT_MAX_PROBLEMS = 100


@dataclass(frozen=True)
class Problem:
    line: int | None  # None for problems about the whole file
    field: str | None
    code: str
    message: str

    def __str__(self) -> str:
        where = f"line {self.line}" if self.line is not None else "file"
        if self.field:
            where += f": {self.field}"
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class HistogramBucket:
    min: int
    max: int
    count: int


@dataclass
class ValidationReport:
    path: str
    format: str | None = None
    n_lines: int = 0
    n_examples: int = 0  # well-formed examples (they may still be too long, duplicated or overlapping)
    n_tokens: int | None = None  # None without a tokenizer
    n_trained_tokens: int | None = None
    max_example_tokens: int | None = None
    length_unit: str = "characters"  # "tokens" when a tokenizer was given
    length_histogram: list[HistogramBucket] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    n_problems: int = 0
    max_problems: int = DEFAULT_MAX_PROBLEMS

    @property
    def is_valid(self) -> bool:
        return self.n_problems == 0

    @property
    def problems_not_listed(self) -> int:
        return self.n_problems - len(self.problems)

    def add(self, problem: Problem) -> None:
        self.n_problems += 1
        if len(self.problems) < self.max_problems:
            self.problems.append(problem)

    def problem_lines(self) -> list[str]:
        lines = [str(problem) for problem in self.problems]
        if self.problems_not_listed:
            lines.append(f"... and {self.problems_not_listed} more problems not listed")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; leaves out `path` so API errors do not reveal where the server stores uploads."""
        data = asdict(self)
        del data["path"]
        data["is_valid"] = self.is_valid
        data["problems_not_listed"] = self.problems_not_listed
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str | os.PathLike[str]) -> ValidationReport:
        """The report `to_dict` gave, for the file now at `path`."""
        fields = {key: value for key, value in data.items() if key not in ("is_valid", "problems_not_listed")}
        fields["length_histogram"] = [HistogramBucket(**bucket) for bucket in data["length_histogram"]]
        fields["problems"] = [Problem(**problem) for problem in data["problems"]]
        return cls(path=os.fspath(path), **fields)


def validate_dataset(
    path: str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_seq_len: int | None = None,
    other_path: str | os.PathLike[str] | None = None,
    max_problems: int = DEFAULT_MAX_PROBLEMS,
) -> ValidationReport:
    """Check every line of `path`; `other_path` is the paired file (validation for a training file) checked for
    overlap. Token counts, the template check and `max_seq_len` need `tokenizer`."""
    if max_seq_len is not None and tokenizer is None:
        raise ValueError("max_seq_len needs a tokenizer: lengths are counted in tokens after templating")
    if max_problems < 1:
        raise ValueError("max_problems must be at least 1")

    report = ValidationReport(path=os.fspath(path), max_problems=max_problems)
    other_hashes = _example_hashes(other_path) if other_path is not None else {}
    seen: dict[bytes, int] = {}
    lengths = _LengthHistogram()
    n_tokens = n_trained = 0
    special_tokens = _special_token_strings(tokenizer)

    for line_number, record in _read_records(path, report):
        example = _parsed_example(record, line_number, report)
        if example is None:
            continue
        _check_repeats(_hash(record), line_number, seen, other_hashes, report)
        if tokenizer is None:
            lengths.add(sum(len(text) for _, text in example.strings()))
            report.n_examples += 1
            continue
        tokenized = _tokenized_sequences(example, line_number, tokenizer, special_tokens, report)
        if tokenized is None:
            continue
        longest = max(len(sequence.input_ids) for sequence in tokenized)
        if max_seq_len is not None and longest > max_seq_len:
            message = f"{longest} tokens after templating, more than max_seq_len {max_seq_len}"
            report.add(Problem(line_number, None, "too_long", message))
        report.n_examples += 1
        n_tokens += sum(len(sequence.input_ids) for sequence in tokenized)
        n_trained += sum(sequence.n_trained for sequence in tokenized)
        lengths.add(longest)

    if report.n_lines == 0:
        report.add(Problem(None, None, "empty_file", "the file has no examples"))
    if tokenizer is not None:
        report.n_tokens, report.n_trained_tokens = n_tokens, n_trained
        report.length_unit = "tokens"
        if report.n_examples and n_trained == 0:
            report.add(Problem(None, None, "no_trained_tokens", "the dataset would train zero tokens"))
    report.max_example_tokens = lengths.maximum if tokenizer is not None else None
    report.length_histogram = lengths.buckets()
    return report


def _parsed_example(record: Any, line_number: int, report: ValidationReport) -> Example | None:
    """The line's example, or None when it has problems (reported); the first example sets the file's format."""
    example, field_problems = parse_record(record)
    if example is not None and report.format is None:
        report.format = example.format.value
    elif example is not None and example.format.value != report.format:
        message = f"this line is in {example.format.value} format but the file started in {report.format} format"
        field_problems.append(FieldProblem("mixed_formats", None, message))
        example = None
    for problem in field_problems:
        report.add(Problem(line_number, problem.field, problem.code, problem.message))
    return example


def _check_repeats(
    digest: bytes, line_number: int, seen: dict[bytes, int], other_hashes: dict[bytes, int], report: ValidationReport
) -> None:
    """Report an example seen earlier in the file or found in the paired file; remember its first line."""
    if digest in seen:
        report.add(Problem(line_number, None, "duplicate", f"duplicate of line {seen[digest]}"))
    else:
        seen[digest] = line_number
    if digest in other_hashes:
        message = f"the same example is line {other_hashes[digest]} of the other (validation) file"
        report.add(Problem(line_number, None, "overlap", message))


def _tokenized_sequences(
    example: Example,
    line_number: int,
    tokenizer: PreTrainedTokenizerBase,
    special_tokens: list[str],
    report: ValidationReport,
) -> list[TokenizedExample] | None:
    """The example's sequences tokenized, or None when it cannot be used (special tokens in its content, a
    template that cannot render it: reported)."""
    if not _has_no_special_tokens(example, line_number, special_tokens, report):
        return None
    # A preference example is two sequences, the input with each answer: both are trained on.
    sequences = example.conversations() if example.format is DatasetFormat.PREFERENCE else (example,)
    results = [_tokenized(sequence, line_number, tokenizer, report) for sequence in sequences]
    tokenized = [sequence for sequence in results if sequence is not None]
    return tokenized if len(tokenized) == len(results) else None  # else one did not tokenize (reported)


def _has_no_special_tokens(
    example: Example, line_number: int, special_tokens: list[str], report: ValidationReport
) -> bool:
    """Report every special token written into the content (the tokenizer would read it as a control token)."""
    ok = True
    for field_path, text in example.strings():
        for token in special_tokens:
            if token in text:
                message = f"contains the special token {token!r}, which would be read as a control token"
                report.add(Problem(line_number, field_path, "special_token_in_content", message))
                ok = False
    return ok


def _tokenized(
    example: Example, line_number: int, tokenizer: PreTrainedTokenizerBase, report: ValidationReport
) -> TokenizedExample | None:
    """Tokenize, reporting a template that cannot render the example; None when the example cannot be used."""
    try:
        return tokenize_example(example, tokenizer)
    except TemplateError as error:
        report.add(Problem(line_number, None, "template_error", str(error)))
        return None


def _read_records(path: str | os.PathLike[str], report: ValidationReport) -> Iterator[tuple[int, Any]]:
    """Yield (line number, decoded JSON) for each line; undecodable lines become problems and are skipped."""
    with open(path, "rb") as file:
        for line_number, raw in enumerate(file, start=1):
            report.n_lines = line_number
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                message = f"invalid UTF-8 (byte 0x{raw[error.start]:02x} at column {error.start + 1})"
                report.add(Problem(line_number, None, "invalid_utf8", message))
                continue
            if not text.strip():
                report.add(Problem(line_number, None, "invalid_json", "empty line"))
                continue
            try:
                record = json.loads(text)
                # A lone surrogate escape ("\ud800") decodes to a string that is not Unicode: nothing downstream
                # (hashing, tokenizers) can encode it.
                json.dumps(record, ensure_ascii=False).encode("utf-8")
            except json.JSONDecodeError as error:
                message = f"invalid JSON: {error.msg} (column {error.colno})"
                report.add(Problem(line_number, None, "invalid_json", message))
            except RecursionError:
                report.add(Problem(line_number, None, "invalid_json", "invalid JSON: nested too deeply"))
            except UnicodeEncodeError:
                message = "a \\u escape encodes a lone surrogate, which is not valid Unicode"
                report.add(Problem(line_number, None, "invalid_unicode", message))
            else:
                yield line_number, record


def _example_hashes(path: str | os.PathLike[str]) -> dict[bytes, int]:
    """Hash of every parseable line of the paired file, to its first line number."""
    hashes: dict[bytes, int] = {}
    with open(path, "rb") as file:
        for line_number, raw in enumerate(file, start=1):
            try:
                record = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            hashes.setdefault(_hash(record), line_number)
    return hashes


def _hash(record: Any) -> bytes:
    # Canonical JSON: key order and whitespace do not make two identical examples look different.
    canonical = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=16).digest()


def _special_token_strings(tokenizer: PreTrainedTokenizerBase | None) -> list[str]:
    return [] if tokenizer is None else list(tokenizer.all_special_tokens)


class _LengthHistogram:
    """Counts per power-of-two bucket: 1-64, 65-128, 129-256, ..."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.maximum = 0

    def add(self, length: int) -> None:
        upper = max(64, 1 << max(length - 1, 0).bit_length())
        self.counts[upper] = self.counts.get(upper, 0) + 1
        self.maximum = max(self.maximum, length)

    def buckets(self) -> list[HistogramBucket]:
        return [
            HistogramBucket(min=1 if upper == 64 else upper // 2 + 1, max=upper, count=self.counts[upper])
            for upper in sorted(self.counts)
        ]
