"""Find personal data in a JSONL dataset and optionally write a redacted copy with typed placeholders.

Detection uses maintained, offline libraries wherever they fit and patterns only to find candidates:
- IBAN: `python-stdnum` (`stdnum.iban`: country format + mod-97 checksum), so a mistyped IBAN is not reported.
- CARD_NUMBER: 13-19 digits starting like a card network (2-6) that pass the Luhn check (`stdnum.luhn`).
- US_SSN: `stdnum.us.ssn` (rejects impossible area/group/serial numbers and known advertising numbers); written as
  AAA-GG-SSSS, or nine digits right after the word "SSN".
- PHONE_NUMBER: Google's `phonenumbers` matcher at its VALID leniency (real numbering plans; `default_region` for
  numbers without a country code).
- EMAIL: a pattern (no library adds anything for e-mail addresses), anchored on each "@" so that a long run of
  address-like characters is read once rather than once per starting position.
- ACCOUNT_NUMBER: digits introduced by "account", "acct" or "a/c" (an account number has no checksum to test).

Every finder and the overlap resolution take time linear in the length of the text: the patterns have no unbounded
quantifiers that can be retried from many positions, so a hostile line of any shape costs no more than an ordinary
line of the same length.

- PERSON (optional): a spaCy NER pipeline named by `person_model` (`finetune.datasets.person_names`, extra `pii`).
  A statistical model is needed for names and spaCy's are released on GitHub, not on PyPI, so none is installed by
  default; without one the report lists PERSON in `not_scanned`. On overlap the structured types above win.

JSON lines are scanned value by value (keys are structure, not data) and re-serialised after redaction, so the
redacted copy is still a valid dataset; lines that are not JSON are scanned and redacted as raw text. Bytes that
are not UTF-8 are read as U+FFFD (the validator reports such lines).
"""

from __future__ import annotations

import bisect
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import phonenumbers
from stdnum import iban, luhn
from stdnum.us import ssn

from zaya_model.training.atomic_io import write_lines_atomic

from .person_names import PersonFinder, load_person_finder

PII_TYPES = ("EMAIL", "IBAN", "CARD_NUMBER", "US_SSN", "ACCOUNT_NUMBER", "PHONE_NUMBER")
PERSON = "PERSON"
NOT_SCANNED = {
    PERSON: "person names need a spaCy NER pipeline: install the `pii` extra and a pipeline wheel such as "
    "en_core_web_sm, then pass --person-model",
}

# An address is `\b[A-Za-z0-9._%+-]+@` followed by `_EMAIL_DOMAIN`. Searched as one pattern, every start inside a
# long run of local-part characters without an "@" rescans the run (quadratic), so the local part is found from runs.
_EMAIL_LOCAL_RUN = re.compile(r"[A-Za-z0-9._%+-]+")
_EMAIL_LOCAL_START = re.compile(r"\b[A-Za-z0-9._%+-]")
_EMAIL_DOMAIN = re.compile(r"[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
# Two letters, two check digits, then groups of four (optionally space-separated) and a short tail.
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b")
_CARD = re.compile(r"\b\d(?:[ -]?\d){12,18}\b")
_SSN = re.compile(r"\b\d{3}-\d{2}-\d{4}\b|(?i:\bssn\W{0,3})(?P<bare>\d{9})\b")
# Possessive whitespace: each run of spaces is taken whole once (it is always followed by a non-space), not split
# between the adjacent quantifiers in every possible way.
_ACCOUNT = re.compile(
    r"(?i:\b(?:account|acct|a/c)(?:\s++(?:number|no\.?|num|#))?\s*+(?:[:#]|is)?\s*+)(?P<number>\d[\d-]{4,18}\d)\b"
)


@dataclass(frozen=True)
class PiiMatch:
    type: str
    start: int
    end: int
    text: str


def find_pii(text: str, default_region: str = "US", person_finder: PersonFinder | None = None) -> list[PiiMatch]:
    """Non-overlapping matches sorted by position; on overlap the earlier type in `PII_TYPES` wins, then PERSON."""
    accepted: list[PiiMatch] = []  # sorted by start and non-overlapping, so their ends are sorted too
    finders = {**_FINDERS, PERSON: person_finder} if person_finder is not None else _FINDERS
    for pii_type, finder in finders.items():
        starts = [match.start for match in accepted]
        added: list[PiiMatch] = []
        for start, end in sorted(finder(text, default_region)):
            if added and start < added[-1].end:
                continue  # overlaps a match of this type found just before
            before = bisect.bisect_left(starts, end) - 1  # the last earlier match starting before this one ends
            if before >= 0 and accepted[before].end > start:
                continue
            added.append(PiiMatch(pii_type, start, end, text[start:end]))
        accepted = sorted(accepted + added, key=lambda match: match.start)  # merging two sorted runs: linear
    return accepted


def redact_text(text: str, matches: list[PiiMatch]) -> str:
    """`matches` must not overlap (as `find_pii` returns them)."""
    pieces: list[str] = []
    position = 0
    for match in sorted(matches, key=lambda match: match.start):
        pieces += (text[position : match.start], f"[{match.type}]")
        position = match.end
    pieces.append(text[position:])
    return "".join(pieces)


@dataclass
class PiiReport:
    path: str
    n_lines: int = 0
    n_lines_with_pii: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PII_TYPES, 0))
    example_lines: dict[str, list[int]] = field(default_factory=lambda: {pii_type: [] for pii_type in PII_TYPES})
    not_scanned: dict[str, str] = field(default_factory=lambda: dict(NOT_SCANNED))
    redacted_path: str | None = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "n_lines": self.n_lines,
            "n_lines_with_pii": self.n_lines_with_pii,
            "total": self.total,
            "counts": self.counts,
            "example_lines": self.example_lines,
            "not_scanned": self.not_scanned,
            "redacted_path": self.redacted_path,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str | os.PathLike[str]) -> PiiReport:
        """The report `to_dict` gave, for the file now at `path` (`total` is derived from the counts)."""
        return cls(**{key: value for key, value in data.items() if key not in ("path", "total")}, path=os.fspath(path))


def scan_file(
    path: str | os.PathLike[str],
    redact_to: str | os.PathLike[str] | None = None,
    default_region: str = "US",
    max_example_lines: int = 10,
    person_model: str | None = None,
) -> PiiReport:
    """Stream `path` once; with `redact_to`, write the redacted copy atomically (nothing appears on failure).
    `person_model`: a spaCy pipeline (name or directory) that also finds person names; `PersonModelError` if unusable.
    """
    person_finder = load_person_finder(person_model) if person_model is not None else None
    report = PiiReport(path=os.fspath(path))
    if person_finder is not None:
        report.counts[PERSON], report.example_lines[PERSON] = 0, []
        del report.not_scanned[PERSON]

    def redacted_lines() -> Iterator[str]:
        with open(path, encoding="utf-8", errors="replace") as file:
            for line_number, line in enumerate(file, start=1):
                report.n_lines = line_number
                redacted, found = _redact_line(line.rstrip("\r\n"), default_region, person_finder)
                for pii_type in {match.type for match in found}:
                    if len(report.example_lines[pii_type]) < max_example_lines:
                        report.example_lines[pii_type].append(line_number)
                for match in found:
                    report.counts[match.type] += 1
                report.n_lines_with_pii += bool(found)
                # Lines without PII are copied unchanged, not re-serialised.
                yield (redacted if found else line.rstrip("\r\n")) + "\n"

    if redact_to is None:
        for _ in redacted_lines():
            pass
    else:
        write_lines_atomic(redact_to, redacted_lines())
        report.redacted_path = os.fspath(redact_to)
    return report


def _redact_line(line: str, default_region: str, person_finder: PersonFinder | None) -> tuple[str, list[PiiMatch]]:
    found: list[PiiMatch] = []

    def redact(text: str) -> str:
        matches = find_pii(text, default_region, person_finder)
        found.extend(matches)
        return redact_text(text, matches)

    try:
        return json.dumps(_map_strings(json.loads(line), redact), ensure_ascii=False), found
    except (json.JSONDecodeError, RecursionError):  # not JSON, or nested too deeply to walk: scanned as raw text
        found.clear()
        return redact(line), found


def _map_strings(value: Any, function: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return function(value)
    if isinstance(value, list):
        return [_map_strings(item, function) for item in value]
    if isinstance(value, dict):
        return {key: _map_strings(item, function) for key, item in value.items()}
    return value


def _find_emails(text: str, _region: str) -> Iterator[tuple[int, int]]:
    # Same matches as `re.finditer(r"\b[A-Za-z0-9._%+-]+@" + domain)`: a local part can only end at the "@" that
    # closes its run, so each run followed by "@" is tried once, from its leftmost word boundary at or after the end
    # of the previous address.
    previous_end = 0
    for run in _EMAIL_LOCAL_RUN.finditer(text):
        at = run.end()
        if text[at : at + 1] != "@" or at <= previous_end:
            continue
        start = _EMAIL_LOCAL_START.search(text, max(run.start(), previous_end), at)
        if start is None:
            continue
        domain = _EMAIL_DOMAIN.match(text, at + 1)
        if domain is None:
            continue
        previous_end = domain.end()
        yield start.start(), previous_end


def _find_ibans(text: str, _region: str) -> Iterator[tuple[int, int]]:
    for match in _IBAN.finditer(text):
        if iban.is_valid(match.group()):
            yield match.span()


def _find_cards(text: str, _region: str) -> Iterator[tuple[int, int]]:
    # Digits inside an IBAN-shaped string (even one failing its checksum) belong to that IBAN, not to a card.
    iban_shaped = [match.span() for match in _IBAN.finditer(text)]  # sorted, non-overlapping
    iban_starts = [start for start, _ in iban_shaped]
    for match in _CARD.finditer(text):
        before = bisect.bisect_left(iban_starts, match.end()) - 1
        if before >= 0 and iban_shaped[before][1] > match.start():
            continue
        digits = re.sub(r"\D", "", match.group())
        if 13 <= len(digits) <= 19 and digits[0] in "23456" and luhn.is_valid(digits):
            yield match.span()


def _find_ssns(text: str, _region: str) -> Iterator[tuple[int, int]]:
    for match in _SSN.finditer(text):
        group = "bare" if match.group("bare") else 0
        if ssn.is_valid(match.group(group)):
            yield match.span(group)


def _find_accounts(text: str, _region: str) -> Iterator[tuple[int, int]]:
    for match in _ACCOUNT.finditer(text):
        yield match.span("number")


def _find_phones(text: str, region: str) -> Iterator[tuple[int, int]]:
    for match in phonenumbers.PhoneNumberMatcher(text, region, leniency=phonenumbers.Leniency.VALID):
        yield match.start, match.end


_FINDERS: dict[str, Callable[[str, str], Iterator[tuple[int, int]]]] = {
    "EMAIL": _find_emails,
    "IBAN": _find_ibans,
    "CARD_NUMBER": _find_cards,
    "US_SSN": _find_ssns,
    "ACCOUNT_NUMBER": _find_accounts,
    "PHONE_NUMBER": _find_phones,
}
