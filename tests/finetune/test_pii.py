"""PII scanning: checksum-validated detections, counts per type with line numbers, atomic redacted copies."""

from __future__ import annotations

import json
import os
import time

import pytest
from finetune_helpers import chat

from finetune.datasets.pii import PII_TYPES, find_pii, redact_text, scan_file

POSITIVES = {
    "EMAIL": "write to jane.doe@example.com today",
    "IBAN": "pay DE89 3704 0044 0532 0130 00 now",
    "CARD_NUMBER": "card 4111-1111-1111-1111 was used",
    "US_SSN": "SSN 123-45-6789 on file",
    "ACCOUNT_NUMBER": "funds left account no. 00123456789 yesterday",
    "PHONE_NUMBER": "call (212) 555-0147 or +44 20 7946 0958",
}
# Each looks like PII but fails its checksum or numbering rules, so it must not be reported.
NEGATIVES = [
    "pay DE89 3704 0044 0532 0130 01 now",  # IBAN with a wrong check digit
    "GB82 WEST 1234 5698 7654 33",  # IBAN with a wrong check digit
    "card 4111 1111 1111 1112 was used",  # fails Luhn
    "SSN 666-12-3456 and 078-05-1120",  # impossible area 666; a known advertising number
    "amount $25,000.00 on 2024-03-05, reference 20240305123",
]


@pytest.mark.parametrize("pii_type", PII_TYPES)
def test_finds_each_type(pii_type):
    matches = find_pii(POSITIVES[pii_type])
    assert matches and {match.type for match in matches} == {pii_type}


def test_checksum_failures_are_not_reported():
    for text in NEGATIVES:
        assert find_pii(text) == [], text


def test_redaction_uses_typed_placeholders():
    text = "IBAN GB82 WEST 1234 5698 7654 32, e-mail a.b@bank.co.uk, ssn: 234567890, acct #998877"
    assert redact_text(text, find_pii(text)) == "IBAN [IBAN], e-mail [EMAIL], ssn: [US_SSN], acct #[ACCOUNT_NUMBER]"


def test_scan_file_counts_types_with_example_lines(write_jsonl):
    lines = [
        chat(user=POSITIVES["IBAN"]),
        chat(user="nothing personal here"),
        chat(user=POSITIVES["PHONE_NUMBER"], answer=POSITIVES["EMAIL"]),
        "not json: " + POSITIVES["CARD_NUMBER"],
        chat(user=NEGATIVES[0]),
    ]
    report = scan_file(write_jsonl(lines))
    assert report.counts == {
        "EMAIL": 1,
        "IBAN": 1,
        "CARD_NUMBER": 1,
        "US_SSN": 0,
        "ACCOUNT_NUMBER": 0,
        "PHONE_NUMBER": 2,
    }
    assert report.example_lines["IBAN"] == [1]
    assert report.example_lines["PHONE_NUMBER"] == [3]
    assert report.example_lines["CARD_NUMBER"] == [4]
    assert (report.n_lines, report.n_lines_with_pii, report.total) == (5, 3, 5)
    assert "PERSON" in report.not_scanned and "spaCy" in report.not_scanned["PERSON"]
    assert report.to_dict()["redacted_path"] is None


def test_redacted_copy_is_a_valid_dataset_written_atomically(write_jsonl, tmp_path):
    clean = '{"text": "clean",   "spacing": "kept"}'
    original = write_jsonl([chat(user=POSITIVES["US_SSN"]), clean, "raw acct 123456"])
    out = tmp_path / "redacted.jsonl"
    report = scan_file(original, redact_to=out)

    redacted = out.read_text(encoding="utf-8").splitlines()
    assert json.loads(redacted[0])["messages"][1]["content"] == "SSN [US_SSN] on file"
    assert redacted[1] == '{"text": "clean",   "spacing": "kept"}'  # lines without PII are copied byte for byte
    assert redacted[2] == "raw acct [ACCOUNT_NUMBER]"
    assert report.redacted_path == str(out)
    assert sorted(os.listdir(tmp_path)) == ["data.jsonl", "redacted.jsonl"]  # no temporary file left behind


def test_failed_redaction_leaves_nothing_behind(write_jsonl, tmp_path):
    original = write_jsonl([chat(user=POSITIVES["EMAIL"])])
    target = tmp_path / "is_a_directory"
    target.mkdir()
    with pytest.raises(OSError):
        scan_file(original, redact_to=target)
    assert sorted(os.listdir(tmp_path)) == ["data.jsonl", "is_a_directory"]
    assert os.listdir(target) == []


# Lines shaped to make a backtracking pattern retry a long run from every position (each took seconds to minutes at
# 200 kB before the finders were made linear), plus lines with many matches for the overlap resolution.
HOSTILE_LINES = {
    "dotted_words": lambda n: "a." * (n // 2),
    "hyphenated_words": lambda n: "a-" * (n // 2),
    "digits_and_dashes": lambda n: "1-" * (n // 2),
    "domain_without_tld": lambda n: "a@" + "b." * (n // 2),
    "at_signs": lambda n: "@" * n,
    "digit_run": lambda n: "1" * n,
    "account_then_spaces": lambda n: "account number" + " " * n + "x",
    "many_addresses": lambda n: "a@b.co " * (n // 7),
    "ibans_beside_cards": lambda n: "DE89 3704 0044 0532 0130 00 4111111111111111 " * (n // 45),
}


def _fastest_scan(text: str) -> float:
    timings = []
    for _ in range(2):
        started = time.perf_counter()
        find_pii(text)
        timings.append(time.perf_counter() - started)
    return min(timings)


def _ordinary_line(length: int) -> str:
    """Text dense with PII and look-alikes: every positive and negative above, repeated to `length` characters."""
    sentence = " ".join([*POSITIVES.values(), *NEGATIVES]) + " "
    return (sentence * (length // len(sentence) + 1))[:length]


@pytest.mark.parametrize("shape", HOSTILE_LINES)
def test_hostile_lines_scan_in_linear_time(shape):
    build = HOSTILE_LINES[shape]
    small, large = _fastest_scan(build(12_500)), _fastest_scan(build(50_000))
    # 4x the text: linear is 4x the time, the quadratic patterns were 16x; the constant absorbs timer noise.
    assert large < 8 * small + 0.05, (shape, small, large)
    # No dearer than ordinary text of the same length by more than a constant factor. Both are timed in this test, so
    # a loaded machine slows them alike.
    ordinary = _fastest_scan(_ordinary_line(50_000))
    assert large < 10 * ordinary + 0.05, (shape, ordinary, large)


def test_phone_candidates_scan_in_linear_time():
    # The phone matcher is linear but tries every inner candidate of a digit block: keep the sizes small.
    small, large = _fastest_scan("12 " * 1_500), _fastest_scan("12 " * 6_000)
    assert large < 8 * small + 0.05, (small, large)


def test_line_that_took_40_seconds_scans_in_under_a_second(write_jsonl):
    line = "a." * 100_000  # 200 kB
    started = time.perf_counter()
    report = scan_file(write_jsonl([chat(user=line), chat(user=line + " " + POSITIVES["EMAIL"])]))
    assert time.perf_counter() - started < 1.0
    assert report.counts["EMAIL"] == 1 and report.example_lines["EMAIL"] == [2]


def test_many_matches_on_one_line_are_all_found_and_redacted():
    text = " ".join(f"user{i}@example.com" for i in range(5_000))
    matches = find_pii(text)
    assert [match.text for match in matches] == [f"user{i}@example.com" for i in range(5_000)]
    assert redact_text(text, matches) == " ".join(["[EMAIL]"] * 5_000)


def test_line_nested_too_deeply_is_scanned_as_text(write_jsonl):
    deep = "[" * 5_000 + json.dumps(POSITIVES["EMAIL"]) + "]" * 5_000
    report = scan_file(write_jsonl([deep]))
    assert report.counts["EMAIL"] == 1 and report.n_lines_with_pii == 1
