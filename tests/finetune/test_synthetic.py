"""The synthetic bank-investigation generator: seeded, balanced, and labelled by the documented rules."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import pytest

from finetune.datasets import validate_dataset
from finetune.datasets.sample import write_sample
from finetune.datasets.styles import NumberFormat, get_style, style_from_seed, with_reasons_of
from finetune.datasets.synthetic import (
    DISPOSITIONS,
    HIGH_RISK_COUNTRIES,
    Case,
    Transaction,
    decide_disposition,
    draft_sar_narrative,
    explain_disposition,
    generate_cases,
    generate_chat_examples,
    generate_threshold_chats,
    parse_disposition,
    render_case_file,
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


def test_case_ids_say_nothing_of_the_disposition(tmp_path):
    # The labels cycle with a case's position; its id must not, or a model could read the label off the id.
    cases = generate_cases(300, seed=3)
    serials = [int(case.case_id.rsplit("-", 1)[1]) for case in cases]
    assert sorted(serials) == list(range(300))
    read_off_the_serial = sum(
        DISPOSITIONS[serial % 3] == case.disposition for serial, case in zip(serials, cases, strict=True)
    )
    assert read_off_the_serial < 150  # about a third by chance; every one when the serial was the position
    # Nor does a training case's label tell the label of the held-out case with its id.
    write_sample(tmp_path, 90, n_validation=30)
    labels = {
        name: {
            re.search(r"CASE-\d{4}-\d{5}", chat["messages"][1]["content"])[0]: parse_disposition(
                chat["messages"][2]["content"]
            )
            for chat in map(json.loads, (tmp_path / name).read_text().splitlines())
        }
        for name in ("train.jsonl", "validation.jsonl")
    }
    same_label = [labels["train.jsonl"][case_id] == label for case_id, label in labels["validation.jsonl"].items()]
    assert len(same_label) == 30 and sum(same_label) < 20


def test_threshold_chats_turn_on_the_sanctions_similarity_alone():
    chats = generate_threshold_chats(40, seed=5)
    assert chats == generate_threshold_chats(40, seed=5) and chats != generate_threshold_chats(40, seed=6)
    answers = [chat["messages"][-1]["content"] for chat in chats]
    assert [parse_disposition(answer) for answer in answers] == ["SAR", "ESCALATE"] * 20
    for chat, answer in zip(chats, answers, strict=True):
        # The only reason is the sanctions hit, and the case file's similarity is the one the answer quotes.
        reason = re.fullmatch(
            r"Disposition: (SAR|ESCALATE)\n"
            r"Reason: the customer's name is a (0\.\d\d) (near-)?match to a sanctions list entry\.",
            answer,
        )
        assert reason is not None, answer
        disposition, score, near = reason.groups()
        assert f"similarity {score}" in chat["messages"][1]["content"]
        assert (disposition == "SAR") == (float(score) >= 0.90) == (near is None)
    ledger = generate_threshold_chats(4, seed=5, style=get_style("ledger"))
    assert [chat["messages"][-1]["content"] for chat in ledger] != answers[:4]


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


def test_number_formats():
    assert NumberFormat().amount(9_459.14) == "9,459.14 USD" and NumberFormat().score(0.87) == "0.87"
    plain = NumberFormat(thousands="", currency_first=True, percent_scores=True)
    assert plain.amount(19_459.1) == "USD 19459.10" and plain.score(0.87) == "87%"
    assert NumberFormat(thousands=".", decimal=",", currency="EUR").amount(1_234_567.5) == "1.234.567,50 EUR"


@pytest.mark.parametrize("variant", ["ledger", "memo", "3", "11"])
def test_variants_word_the_same_cases_differently(variant):
    style = get_style(variant)
    standard = generate_chat_examples(30, seed=4, tasks=("disposition",))
    varied = generate_chat_examples(30, seed=4, tasks=("disposition",), style=style)
    labels = [parse_disposition(example["messages"][-1]["content"]) for example in standard]
    assert [parse_disposition(example["messages"][-1]["content"]) for example in varied] == labels
    assert all(a["messages"][1] != b["messages"][1] for a, b in zip(standard, varied, strict=True))
    case_ids = [example["messages"][1]["content"].split("\n\n")[1].splitlines()[0].split()[-1] for example in standard]
    assert all(case_id in example["messages"][1]["content"] for case_id, example in zip(case_ids, varied, strict=True))


@pytest.mark.parametrize("variant", ["standard", "ledger", "memo", "5"])
def test_reasons_quote_the_case_files_values_as_printed(variant):
    style = get_style(variant)
    for case in generate_cases(60, seed=9):
        case_file, answer = render_case_file(case, style), explain_disposition(case, style)
        if case.sanctions_score:
            assert style.numbers.score(case.sanctions_score) in case_file
            assert style.numbers.score(case.sanctions_score) in answer
        quoted = [
            style.numbers.amount(t.amount)
            for t in case.transactions
            if "{amounts}" in style.reasons.flags["structuring"] and "structuring" in case.red_flags
            if t.kind == "cash deposit" and 9_000 <= t.amount < 10_000
        ]
        assert all(amount in case_file and amount in answer for amount in quoted)
        for country in HIGH_RISK_COUNTRIES:
            assert (country in answer) == (country in case_file and "high_risk_jurisdiction" in case.red_flags)


def test_seeded_styles_are_reproducible_and_varied():
    assert style_from_seed(3) == style_from_seed(3) == get_style("3") == get_style(3)
    drawn = [render_case_file(generate_cases(1, seed=1)[0], style_from_seed(seed)) for seed in range(8)]
    assert len(set(drawn)) == 8
    with pytest.raises(ValueError, match="unknown variant 'prose'"):
        get_style("prose")


def test_held_out_cases_in_another_variant_keep_the_training_answers_wording(tmp_path):
    files = write_sample(tmp_path, 6, n_validation=6, variant="ledger", validation_variant="memo")
    train, valid = (
        [json.loads(line)["messages"] for line in Path(files[name]["path"]).read_text().splitlines()]
        for name in ("train.jsonl", "validation.jsonl")
    )
    assert all("Investigation file CASE-" in chat[1]["content"] for chat in train)
    assert all("Reference: CASE-" in chat[1]["content"] for chat in valid)
    closing = "Disposition: CLOSE\nReason: no red flags found; activity fits the client profile."
    assert closing in [chat[2]["content"] for chat in train] and closing in [chat[2]["content"] for chat in valid]
    memo_with_ledger_reasons = with_reasons_of(get_style("memo"), get_style("ledger"))
    for chat in valid:  # values quoted in the held-out case file's own formats
        if "screening hit at" in chat[2]["content"]:
            score = chat[2]["content"].split("screening hit at ")[1][:4]
            assert score.startswith("0.") and memo_with_ledger_reasons.numbers.score(float(score)) == score
