"""`evaluate_model` and the `zaya finetune` / `zaya evaluate` commands: scores, adapter checks, exit codes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from finetune_helpers import chat
from tiny_models import TINY_ZAYA, randomize_zaya

from finetune.data import read_examples
from finetune.datasets.formats import parse_record
from finetune.evaluate import (
    EvaluationError,
    answer_fields,
    evaluate_model,
    generate_answers,
    load_model,
    score_answers,
    task_examples,
)
from zaya_cli.main import main
from zaya_model import ZayaForCausalLM
from zaya_model.configuration_zaya import ZayaConfig

LABELS = ("CLOSE", "ESCALATE", "SAR")


def disposition_chats(n, offset=0):
    indices = range(offset, offset + n)
    return [chat(user=f"Case {i}: {i % 3} red flags.", answer=f"Disposition: {LABELS[i % 3]}") for i in indices]


def save_tiny_model(directory, tokenizer, seed):
    torch.manual_seed(seed)
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    model = randomize_zaya(ZayaForCausalLM(ZayaConfig(**{**TINY_ZAYA, "vocab_size": len(tokenizer), **ids})), seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("base"), tokenizer, seed=0)


@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    """A short LoRA run through the CLI: (output dir, train file, held-out file)."""
    directory = tmp_path_factory.mktemp("run")
    train, held_out = directory / "train.jsonl", directory / "held_out.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in disposition_chats(9)))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in disposition_chats(3, offset=50)))
    argv = [
        "finetune",
        "--model",
        model_dir,
        "--train",
        str(train),
        "--output",
        str(directory / "out"),
        "--max-steps",
        "12",
        "--batch-size",
        "3",
        "--learning-rate-multiplier",
        "50",
        "--keep-checkpoints",
        "1",
    ]
    assert main(argv) == 0
    # Checkpoints at every epoch end (steps 3, 6, 9, 12); without validation there is no best, so only the newest.
    assert os.listdir(directory / "out" / "checkpoints") == ["checkpoint-12"]
    return directory / "out", str(train), str(held_out)


def test_scores_of_the_base_model(model_dir, trained):
    scores = evaluate_model(model_dir, trained[2])
    assert scores["n_examples"] == 3 and scores["n_trained_tokens"] > 0 and scores["loss"] > 0
    task = scores["task_evaluation"]
    assert task["n_examples"] == 3 and task["fields"]["Disposition"]["n"] == 3
    assert 0 <= scores["token_accuracy"] <= 1 and 0 <= task["fields"]["Disposition"]["accuracy"] <= 1


def test_text_data_has_no_task_score_and_free_text_no_field_score(model_dir, write_jsonl):
    text = evaluate_model(model_dir, str(write_jsonl([{"text": "Case 1: closed."}], "text.jsonl")))
    assert text["task_evaluation"]["n_examples"] == 0 and text["task_evaluation"]["exact_match"] is None
    free = evaluate_model(model_dir, str(write_jsonl([chat(answer="The case can be closed.")], "free.jsonl")))
    assert free["task_evaluation"]["n_examples"] == 1 and free["task_evaluation"]["fields"] == {}


@pytest.mark.parametrize(
    ("reference", "answer", "exact", "fields"),
    [
        ("Disposition: FILE_SAR\nReasons: a; b", "Disposition: FILE_SAR\nReasons: a; b", 1.0, (1.0, 1.0)),
        ("Disposition: FILE_SAR\nReasons: a; b", "  Disposition: FILE_SAR  \n\nReasons: a; b\n", 1.0, (1.0, 1.0)),
        ("Disposition: FILE_SAR\nReasons: a; b", "Disposition: FILE_SAR\nReasons: a", 0.0, (1.0, 0.0)),
        ("Disposition: FILE_SAR\nReasons: a; b", "Reasons: a; b\nDisposition: CLOSE", 0.0, (0.0, 1.0)),
        ("Disposition: FILE_SAR\nReasons: a; b", "I think FILE_SAR.", 0.0, (0.0, 0.0)),
        ("Disposition: FILE_SAR\nReasons: a; b", "", 0.0, (0.0, 0.0)),
    ],
)
def test_answers_are_scored_whole_and_field_by_field(reference, answer, exact, fields):
    scores = score_answers([reference], [answer])
    assert scores.exact_match == exact
    assert (scores.fields["Disposition"]["accuracy"], scores.fields["Reasons"]["accuracy"]) == fields
    assert answer_fields("Summary: fine\nno colon here") is None


def test_field_accuracy_counts_only_references_with_the_field():
    references = ["Disposition: CLOSE", "Disposition: ESCALATE\nReasons: x", "Just text."]
    scores = score_answers(references, ["Disposition: CLOSE", "Disposition: CLOSE\nReasons: x", "Just text."])
    assert scores.n_examples == 3 and scores.exact_match == 2 / 3
    assert scores.fields == {"Disposition": {"accuracy": 0.5, "n": 2}, "Reasons": {"accuracy": 1.0, "n": 1}}


def test_batched_answers_equal_one_at_a_time(model_dir, trained, tokenizer):
    model, _ = load_model(model_dir)
    examples = read_examples(trained[2]) + [
        *read_examples(trained[1])[:2],
        parse_record(chat(user="A much longer case description " * 6))[0],
    ]
    tasks = task_examples(examples, tokenizer)
    assert len({len(task.prompt_ids) for task in tasks}) > 1  # the batch needs left padding
    batched = generate_answers(model, tokenizer, tasks, batch_size=len(tasks))
    assert batched == [generate_answers(model, tokenizer, [task], batch_size=1)[0] for task in tasks]
    assert all(batched)  # the random base model runs on to the length limit: every position is compared


def test_adapter_lowers_the_loss_and_refuses_another_base(model_dir, trained, tokenizer, tmp_path):
    adapter = str(trained[0] / "final")
    base_scores = evaluate_model(model_dir, trained[2])
    tuned_scores = evaluate_model(model_dir, trained[2], adapter_dir=adapter)
    assert tuned_scores["loss"] < base_scores["loss"]
    assert tuned_scores["token_accuracy"] > base_scores["token_accuracy"]

    other_base = save_tiny_model(tmp_path / "other", tokenizer, seed=1)
    with pytest.raises(EvaluationError, match="trained on a different base model"):
        evaluate_model(other_base, trained[2], adapter_dir=adapter)
    with pytest.raises(EvaluationError, match="not an adapter directory"):
        evaluate_model(model_dir, trained[2], adapter_dir=str(tmp_path))


def test_evaluate_command_prints_a_table_and_json(model_dir, trained, capsys):
    assert main(["evaluate", "--model", model_dir, "--adapter", str(trained[0] / "final"), "--data", trained[2]]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[0] == "n_examples" and lines[0].split()[1] == "3"
    assert json.loads(lines[-1])["n_examples"] == 3

    assert "Disposition accuracy" in "\n".join(lines)
    assert main(["evaluate", "--model", model_dir, "--data", trained[2], "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)) >= {"loss", "token_accuracy", "task_evaluation"}


def test_command_errors_exit_1_with_one_line(model_dir, trained, tmp_path, capsys):
    assert main(["evaluate", "--model", model_dir, "--data", str(tmp_path / "missing.jsonl")]) == 1
    assert "file not found" in capsys.readouterr().err
    common = ["finetune", "--model", model_dir, "--train", trained[1], "--output", str(tmp_path / "o")]
    # The settings model checks the flags before anything loads; the error names the flag.
    assert main([*common, "--n-epochs", "0"]) == 1
    assert capsys.readouterr().err.strip().endswith('--n-epochs: Input should be "auto" or an integer from 1 to 100')
    assert main([*common, "--batch-size", "big"]) == 1
    assert "--batch-size: " in capsys.readouterr().err
    assert main([*common, "--beta", "0.5"]) == 1
    assert capsys.readouterr().err.strip().endswith("--beta: only applies with --type dpo")
    assert main([*common, "--lora-target-modules", "nope", "--max-steps", "1"]) == 1
    assert "--lora-target-modules: no module named 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
