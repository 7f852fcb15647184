"""validate_dataset: every problem kind at its exact line, the listing cap, counts and the report's dict form."""

from __future__ import annotations

import json

import pytest
from finetune_helpers import chat, preference
from transformers import AutoTokenizer

from finetune.datasets import tokenize_example, validate_dataset
from finetune.datasets.formats import parse_record
from finetune.datasets.synthetic import generate_chat_examples


def problem_tuples(report):
    return [(problem.line, problem.field, problem.code) for problem in report.problems]


def test_synthetic_dataset_is_valid_and_counted(tokenizer, write_jsonl):
    examples = generate_chat_examples(9, seed=2)
    report = validate_dataset(write_jsonl(examples), tokenizer=tokenizer, max_seq_len=4096)

    assert report.is_valid, report.problem_lines()
    assert (report.format, report.n_lines, report.n_examples, report.length_unit) == ("chat", 9, 9, "tokens")
    tokenized = [tokenize_example(parse_record(example)[0], tokenizer) for example in examples]
    assert report.n_tokens == sum(len(t.input_ids) for t in tokenized)
    assert report.n_trained_tokens == sum(t.n_trained for t in tokenized)
    assert 0 < report.n_trained_tokens < report.n_tokens
    assert report.max_example_tokens == max(len(t.input_ids) for t in tokenized)
    assert sum(bucket.count for bucket in report.length_histogram) == 9
    for bucket in report.length_histogram:
        lengths_in_bucket = [len(t.input_ids) for t in tokenized if bucket.min <= len(t.input_ids) <= bucket.max]
        assert len(lengths_in_bucket) == bucket.count


def test_every_problem_kind_is_reported_at_its_line(tokenizer, write_jsonl):
    no_assistant = {"messages": [{"role": "user", "content": "hello"}]}
    lines = [
        chat(),  # 1: valid
        '{"messages": [',  # 2
        b'{"text": "caf\xe9"}',  # 3: Latin-1, not UTF-8
        [1, 2],  # 4
        {"foo": 1},  # 5
        {**chat(answer="second"), "extra": True},  # 6
        {"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "ok"}]},  # 7
        chat(answer="   "),  # 8
        no_assistant,  # 9
        chat(answer="w", weight=2),  # 10
        {"messages": "not a list"},  # 11
        chat(),  # 12: duplicate of line 1
        {"prompt": "p", "completion": "c"},  # 13: mixed formats
        "",  # 14: blank line
        chat(answer="leak <|im_end|> here"),  # 15
        chat(answer="long " * 400),  # 16
        {"messages": [{"role": "user", "content": "q", "weight": 1}, {"role": "assistant", "content": "a", "x": 1}]},
        {"messages": [{"content": "q"}, {"role": "assistant", "content": 5}]},  # 18
    ]
    report = validate_dataset(write_jsonl(lines), tokenizer=tokenizer, max_seq_len=512)

    assert problem_tuples(report) == [
        (2, None, "invalid_json"),
        (3, None, "invalid_utf8"),
        (4, None, "wrong_type"),
        (5, None, "missing_key"),
        (6, "extra", "unknown_key"),
        (7, "messages[0].role", "unknown_role"),
        (8, "messages[2].content", "empty_content"),
        (9, "messages", "no_assistant_message"),
        (10, "messages[2].weight", "wrong_type"),
        (11, "messages", "wrong_type"),
        (12, None, "duplicate"),
        (13, None, "mixed_formats"),
        (14, None, "invalid_json"),
        (15, "messages[2].content", "special_token_in_content"),
        (16, None, "too_long"),
        (17, "messages[0].weight", "unknown_key"),
        (17, "messages[1].x", "unknown_key"),
        (18, "messages[0].role", "missing_key"),
        (18, "messages[1].content", "wrong_type"),
    ]
    messages = {problem.line: problem.message for problem in report.problems}
    assert messages[12] == "duplicate of line 1"
    assert messages[3] == "invalid UTF-8 (byte 0xe9 at column 14)"
    assert "unknown role 'bot'" in messages[7]
    assert "more than max_seq_len 512" in messages[16]
    assert not report.is_valid
    assert report.n_examples == 3  # lines 1, 12 and 16 are well-formed
    assert report.format == "chat"


def test_all_weight_zero_trains_nothing(write_jsonl):
    report = validate_dataset(write_jsonl([chat(weight=0)]))
    assert problem_tuples(report) == [(1, "messages", "no_assistant_message")]
    assert "weight 0" in report.problems[0].message


def test_duplicates_ignore_key_order_and_spacing(write_jsonl):
    path = write_jsonl(['{"text": "a", "ignored": 1}', '{"text": "same"}', '{ "text" :  "same" }'])
    report = validate_dataset(path)
    assert problem_tuples(report) == [(1, "ignored", "unknown_key"), (3, None, "duplicate")]
    assert report.problems[1].message == "duplicate of line 2"


def test_overlap_between_training_and_validation(write_jsonl):
    train = write_jsonl([chat(answer="a"), chat(answer="b"), chat(answer="c")], "train.jsonl")
    valid = write_jsonl([chat(answer="x"), chat(answer="c"), "junk"], "valid.jsonl")
    report = validate_dataset(train, other_path=valid)
    assert problem_tuples(report) == [(3, None, "overlap")]
    assert report.problems[0].message == "the same example is line 2 of the other (validation) file"


def test_listing_stops_at_the_cap_and_counts_the_rest(write_jsonl):
    report = validate_dataset(write_jsonl(["{bad"] * 30), max_problems=5)
    assert [problem.line for problem in report.problems] == [1, 2, 3, 4, 5]
    assert (report.n_problems, report.problems_not_listed) == (30, 25)
    assert report.problem_lines()[-1] == "... and 25 more problems not listed"


def test_report_dict_is_json_ready(tokenizer, write_jsonl):
    report = validate_dataset(write_jsonl([chat(), "{bad"]), tokenizer=tokenizer)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["is_valid"] is False and "path" not in data
    message = "invalid JSON: Expecting property name enclosed in double quotes (column 2)"
    assert data["problems"] == [{"line": 2, "field": None, "code": "invalid_json", "message": message}]
    assert data["n_examples"] == 1 and data["n_trained_tokens"] > 0
    assert data["length_histogram"] == [{"min": 1, "max": 64, "count": 1}]
    assert str(report.problems[0]).startswith("line 2: invalid JSON")


def test_prompt_completion_trains_completion_and_eos(tokenizer, write_jsonl):
    report = validate_dataset(write_jsonl([{"prompt": "Case 4 is", "completion": " closed."}]), tokenizer=tokenizer)
    assert report.is_valid and report.format == "prompt_completion"
    completion = tokenizer.encode(" closed.", add_special_tokens=False)
    assert report.n_trained_tokens == len(completion) + 1
    assert report.n_tokens == len(tokenizer.encode("Case 4 is", add_special_tokens=False)) + len(completion) + 1


def test_text_format_trains_everything_but_bos(tokenizer, write_jsonl):
    report = validate_dataset(write_jsonl([{"text": "Wire to Atlas Freight Ltd."}, {"text": ""}]), tokenizer=tokenizer)
    assert problem_tuples(report) == [(2, "text", "empty_content")]
    assert report.n_tokens == report.n_trained_tokens + 1


def test_empty_file_and_counts_without_tokenizer(write_jsonl):
    empty = validate_dataset(write_jsonl([]))
    assert problem_tuples(empty) == [(None, None, "empty_file")]
    report = validate_dataset(write_jsonl([chat(user="abc", answer="de")]))
    assert report.is_valid and report.n_tokens is None and report.length_unit == "characters"
    assert report.length_histogram[0].count == 1


def test_template_without_generation_markers_is_reported(tokenizer_dir, write_jsonl):
    plain = AutoTokenizer.from_pretrained(tokenizer_dir)
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    report = validate_dataset(write_jsonl([chat()]), tokenizer=plain)
    assert problem_tuples(report) == [(1, None, "template_error")]
    assert "generation" in report.problems[0].message


def test_bad_arguments_are_rejected(write_jsonl):
    with pytest.raises(ValueError, match="max_seq_len needs a tokenizer"):
        validate_dataset(write_jsonl([chat()]), max_seq_len=10)
    with pytest.raises(FileNotFoundError):
        validate_dataset("/nonexistent/data.jsonl")


def test_preference_lines_count_both_answers_and_report_problems_at_their_line(tokenizer, write_jsonl):
    good = preference()
    user_last = preference(user="Case 5")
    user_last["input"]["messages"].append({"role": "assistant", "content": "earlier answer"})
    with_tools = preference(user="Case 6")
    with_tools["input"]["tools"] = []
    lines = [
        good,  # 1
        {**preference(user="Case 2"), "non_preferred_output": [{"role": "user", "content": "x"}]},  # 2
        {**preference(user="Case 3"), "preferred_output": "Disposition: CLOSE"},  # 3
        preference(user="Case 4", non_preferred="Disposition: CLOSE"),  # 4: both the same
        user_last,  # 5
        with_tools,  # 6
        {"preferred_output": good["preferred_output"]},  # 7
        chat(),  # 8: another format
        preference(user="Case 9", preferred="long " * 400),  # 9
    ]
    report = validate_dataset(write_jsonl(lines), tokenizer=tokenizer, max_seq_len=512)
    assert report.format == "preference"
    assert problem_tuples(report) == [
        (2, "non_preferred_output[0].role", "wrong_role"),
        (3, "preferred_output", "wrong_type"),
        (4, "non_preferred_output", "same_outputs"),
        (5, "input.messages", "wrong_role"),
        (6, "input.tools", "unknown_key"),
        (7, "input", "missing_key"),
        (7, "non_preferred_output", "missing_key"),
        (8, None, "mixed_formats"),
        (9, None, "too_long"),
    ]

    valid = validate_dataset(write_jsonl([good], "good.jsonl"), tokenizer=tokenizer)
    preferred, non_preferred = parse_record(good)[0].conversations()
    sequences = [tokenize_example(preferred, tokenizer), tokenize_example(non_preferred, tokenizer)]
    assert valid.is_valid and valid.n_examples == 1
    assert valid.n_tokens == sum(len(sequence.input_ids) for sequence in sequences)  # both answers are trained on
    assert valid.n_trained_tokens == sum(sequence.n_trained for sequence in sequences)
