"""Preference fine-tuning (DPO, TRL's DPOTrainer) through `run_finetune`: LoRA and full, the margin of preferred over
non-preferred answers on held-out pairs rises and disposition accuracy does not fall; data of the wrong kind is
refused naming the file."""

from __future__ import annotations

import json
import os

import pytest
from finetune_helpers import LABELS, Recorder, bank_chats, preference, save_tiny_model, spec

from finetune.data import read_examples
from finetune.datasets.validation import validate_dataset
from finetune.evaluate import evaluate_file, load_model, preference_margins
from finetune.run import FinetuneError, run_finetune
from zaya_cli.main import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    """A tiny model taught the disposition answers by a short supervised run: DPO starts from a model that answers,
    so a fall in disposition accuracy (answers broken by the preference training) would show."""
    base = save_tiny_model(tmp_path_factory.mktemp("base"), tokenizer)
    directory = tmp_path_factory.mktemp("sft")
    chats = directory / "chats.jsonl"
    chats.write_text("".join(json.dumps(record) + "\n" for record in bank_chats(24, offset=500)))
    options = {"method": "full", "batch_size": 4, "n_epochs": 100, "max_steps": 60, "learning_rate_multiplier": 3.125}
    result = run_finetune(spec(base, str(chats), directory, **options))
    return result.output_dir


def preference_pairs(n, offset=0):
    """Disposition pairs whose preferred answer carries the label that follows from the red flags (0, 1, 2+)."""
    flags = ["structuring", "rapid movement", "high-risk wire"]
    pairs = []
    for index in range(offset, offset + n):
        count = index % 3
        user = f"Case {index}: red flags: {', '.join(flags[:count]) or 'none'}."
        wrong = LABELS[(count + 1 + index % 2) % 3]
        pairs.append(preference(user, f"Disposition: {LABELS[count]}", f"Disposition: {wrong}"))
    return pairs


@pytest.fixture
def pairs(write_jsonl):
    return str(write_jsonl(preference_pairs(24), "train.jsonl")), str(write_jsonl(preference_pairs(6, 100), "v.jsonl"))


def scores(model_dir, held_out, adapter_dir=None):
    model, tokenizer = load_model(model_dir, adapter_dir)
    margins = preference_margins(model, tokenizer, read_examples(held_out))
    disposition = evaluate_file(model, tokenizer, held_out)["fields"]["Disposition"]["accuracy"]
    return sum(margins) / len(margins), disposition


@pytest.mark.slow  # a supervised run, then two DPO runs: ~90 s on 2 cores
@pytest.mark.parametrize("method", ["lora", "full"])
def test_dpo_raises_the_preferred_margin_on_held_out_pairs(model_dir, pairs, tmp_path, method):
    hooks = Recorder()
    # A moderate rate: at 10x these (full, 2e-3) DPO drove the margin up while the answers degenerated to
    # "Disposition:" alone, the failure the disposition check below catches.
    options = {"method": method, "learning_rate_multiplier": 0.3125 if method == "lora" else 0.625}
    options |= {"beta": 0.1, "batch_size": 4, "n_epochs": 100, "max_steps": 24}
    run = spec(model_dir, pairs[0], tmp_path, type="dpo", validation_file=pairs[1], **options)
    result = run_finetune(run, hooks)
    assert result.status == "succeeded" and result.kind == ("adapter" if method == "lora" else "full")

    margin_before, disposition_before = scores(model_dir, pairs[1])
    adapter = result.output_dir if method == "lora" else None
    margin_after, disposition_after = scores(model_dir if adapter else result.output_dir, pairs[1], adapter)
    assert margin_after > margin_before + 1.0, (margin_before, margin_after)
    assert disposition_after >= disposition_before > 0.5, (disposition_before, disposition_after)
    # The run's own evaluation of the held-out pairs is the one just made from the saved model.
    assert result.evaluation["preference"]["mean_margin"] == pytest.approx(margin_after, abs=1e-3)
    with open(os.path.join(result.output_dir, "evaluation.json")) as file:
        assert json.load(file)["preference"]["n_pairs"] == 6
    # Validation (DPO) losses reached the hooks and the checkpoints, as in a supervised run.
    assert result.metrics["valid_loss"] > 0 and result.checkpoints
    assert hooks.losses and all(loss > 0 for loss in hooks.losses.values())


def test_each_method_refuses_the_other_methods_data(model_dir, pairs, write_jsonl, tmp_path):
    chats = str(write_jsonl(bank_chats(4), "chats.jsonl"))
    with pytest.raises(FinetuneError, match="^train_file: .* a dpo job needs preference data") as error:
        run_finetune(spec(model_dir, chats, tmp_path, type="dpo"))
    assert error.value.field == "train_file"
    with pytest.raises(FinetuneError, match="^train_file: .* is preference data; train on it with method type dpo"):
        run_finetune(spec(model_dir, pairs[0], tmp_path))
    with pytest.raises(FinetuneError, match="^validation_file: .* a dpo job needs preference data"):
        run_finetune(spec(model_dir, pairs[0], tmp_path, type="dpo", validation_file=chats))


def test_dpo_bills_both_answers_once_per_epoch(tokenizer, write_jsonl, tmp_path):
    base = save_tiny_model(tmp_path / "base", tokenizer)
    train = str(write_jsonl(preference_pairs(6), "pairs.jsonl"))
    result = run_finetune(spec(base, train, tmp_path, type="dpo", batch_size=3, n_epochs=2, lora_r=2))
    # The validator counts each pair as its two conversations, the prompt with each answer, trained on the answer up
    # to its end of turn; TRL's completion is the templated text after the prompt, so it also trains the newline the
    # chat template writes after each answer's end of turn: one more token per answer.
    report = validate_dataset(train, tokenizer=tokenizer)
    assert result.trained_tokens == 2 * (report.n_trained_tokens + 2 * report.n_examples)


def test_the_command_line_runs_dpo(model_dir, pairs, tmp_path, capsys):
    argv = ["finetune", "--model", model_dir, "--train", pairs[0], "--output", str(tmp_path / "out")]
    argv += ["--type", "dpo", "--beta", "0.2", "--batch-size", "2", "--max-steps", "2", "--lora-r", "4"]
    assert main(argv) == 0
    assert "succeeded: adapter" in capsys.readouterr().out
    assert (tmp_path / "out" / "final" / "adapter_config.json").is_file()
