"""The synthetic bank-investigation generator: seeded, balanced, and labelled by the documented rules."""

from __future__ import annotations

import datetime

import pytest

from finetune.datasets import validate_dataset
from finetune.datasets.synthetic import (
    DISPOSITIONS,
    Case,
    Transaction,
    decide_disposition,
    draft_sar_narrative,
    generate_cases,
    generate_chat_examples,
    parse_disposition,
)

DAY = datetime.date(2025, 3, 1)


def make_case(transactions=(), sanctions_score=0.0):
    return Case("CASE-1", "Test Person", "nurse", DAY, "1234567890", "low", sanctions_score, tuple(transactions))


def cash(amount, day=0):
    return Transaction(DAY + datetime.timedelta(days=day), "cash deposit", amount, "branch counter", "United States")


def wire(kind, amount, day=0, country="Germany"):
    return Transaction(DAY + datetime.timedelta(days=day), kind, amount, "Atlas Freight Ltd", country)


def test_rules_decide_the_disposition_from_facts():
    assert decide_disposition(make_case([cash(9_500), cash(9_100)])) == "CLOSE"  # two deposits are not a pattern
    structuring = [cash(9_500), cash(9_100, 2), cash(9_999, 5)]
    assert decide_disposition(make_case(structuring)) == "ESCALATE"
    assert decide_disposition(make_case([wire("wire in", 20_000), wire("wire out", 17_000, 2)])) == "ESCALATE"
    assert decide_disposition(make_case([wire("wire in", 20_000), wire("wire out", 17_000, 3)])) == "CLOSE"  # too late
    assert decide_disposition(make_case(structuring + [wire("wire out", 500, country="Iran")])) == "SAR"
    assert decide_disposition(make_case(sanctions_score=0.80)) == "ESCALATE"
    assert decide_disposition(make_case(sanctions_score=0.93)) == "SAR"


def test_generation_is_seeded_and_balanced():
    assert generate_chat_examples(12, seed=4) == generate_chat_examples(12, seed=4)
    assert generate_chat_examples(12, seed=4) != generate_chat_examples(12, seed=5)
    cases = generate_cases(60, seed=1)
    assert [case.disposition for case in cases].count("SAR") == 20
    assert all(decide_disposition(case) == DISPOSITIONS[index % 3] for index, case in enumerate(cases))


def test_disposition_answers_carry_the_label():
    examples = generate_chat_examples(9, seed=3, tasks=("disposition",))
    labels = [parse_disposition(example["messages"][-1]["content"]) for example in examples]
    assert labels == list(DISPOSITIONS) * 3
    assert parse_disposition("I think we should wait.") is None


def test_sar_narratives_only_for_sar_cases():
    for example in generate_chat_examples(4, seed=2, tasks=("sar_narrative",)):
        assert "suspicious" in example["messages"][-1]["content"]
    with pytest.raises(ValueError, match="does not warrant a SAR"):
        draft_sar_narrative(make_case())
    with pytest.raises(ValueError, match="tasks must be"):
        generate_chat_examples(3, tasks=("poetry",))


def test_generated_examples_validate_cleanly(tokenizer, write_jsonl):
    report = validate_dataset(write_jsonl(generate_chat_examples(30, seed=8)), tokenizer=tokenizer)
    assert report.is_valid, report.problem_lines()
    assert report.n_examples == 30 and report.n_trained_tokens > 0
