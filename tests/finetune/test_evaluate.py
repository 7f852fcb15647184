"""`evaluate_model` and the `zaya finetune` / `zaya evaluate` commands: scores, adapter checks, exit codes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from finetune_helpers import chat
from tiny_models import TINY_ZAYA, randomize_zaya

from finetune.evaluate import EvaluationError, evaluate_model
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
    assert scores["n_examples"] == 3 and scores["n_disposition_examples"] == 3
    assert scores["n_trained_tokens"] > 0 and scores["loss"] > 0
    assert 0 <= scores["token_accuracy"] <= 1 and 0 <= scores["disposition_accuracy"] <= 1


def test_prompt_completion_data_has_no_disposition_score(model_dir, write_jsonl):
    data = write_jsonl([{"prompt": "Case 1:", "completion": " Disposition: SAR"}], "pc.jsonl")
    scores = evaluate_model(model_dir, str(data))
    assert scores["disposition_accuracy"] is None and scores["n_disposition_examples"] == 0


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

    assert main(["evaluate", "--model", model_dir, "--data", trained[2], "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)) >= {"loss", "token_accuracy", "disposition_accuracy"}


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
