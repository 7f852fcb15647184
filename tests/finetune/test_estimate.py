"""Before a run: `zaya finetune --dry-run` counts the trained tokens as the trainer bills them (per epoch x epochs,
"auto" resolved) and times the model; after a run, `zaya finetune` prints the tokens it trained."""

from __future__ import annotations

import json

import pytest
from finetune_helpers import preference, save_tiny_model, spec, write_data

from finetune.auto import resolve_hyperparameters
from finetune.data import read_examples
from finetune.datasets.rendering import tokenize_example
from finetune.datasets.validation import validate_dataset
from finetune.estimate import estimate_run
from finetune.settings import FineTuneSettings
from zaya_cli.main import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("base"), tokenizer)


@pytest.fixture
def data(write_jsonl):
    return write_data(write_jsonl)


def trained_per_epoch(path, tokenizer) -> int:
    return sum(tokenize_example(example, tokenizer).n_trained for example in read_examples(path))


def dry_run(argv, capsys) -> tuple[list[str], dict]:
    assert main(["finetune", "--dry-run", *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return lines[:-1], json.loads(lines[-1])


def test_dry_run_counts_trained_tokens_times_epochs_and_times_the_model(model_dir, data, tokenizer, tmp_path, capsys):
    per_epoch = trained_per_epoch(data[0], tokenizer)
    text, estimate = dry_run(["--model", model_dir, "--train", data[0], "--n-epochs", "2", "--batch-size", "3"], capsys)
    assert estimate["n_trained_tokens_per_epoch"] == per_epoch
    assert estimate["trained_tokens"] == 2 * per_epoch
    assert estimate["hyperparameters"]["n_epochs"] == 2 and estimate["n_steps"] == 2 * 3  # 8 examples: 3 batches
    assert estimate["trained_tokens_per_second"] > 0
    rate = estimate["trained_tokens_per_second"]
    assert estimate["estimated_seconds"] == pytest.approx(estimate["trained_tokens"] / rate)
    assert estimate["throughput_source"].startswith("measured")
    assert any(f"= {2 * per_epoch:,}" in line for line in text), text
    assert not (tmp_path / "out").exists()  # nothing trained, nothing written


def test_dry_run_resolves_auto_epochs_as_the_run_does(model_dir, data, tokenizer, capsys):
    _, estimate = dry_run(["--model", model_dir, "--train", data[0], "--no-measure"], capsys)
    epochs = resolve_hyperparameters(FineTuneSettings(), 8).n_epochs
    assert epochs > 3  # few examples: "auto" trains more epochs than the default 3
    assert estimate["hyperparameters"]["n_epochs"] == epochs
    assert estimate["trained_tokens"] == epochs * trained_per_epoch(data[0], tokenizer)
    assert estimate["estimated_seconds"] is None and estimate["throughput_source"] == "not measured"


def test_a_dpo_dry_run_counts_both_answers_and_times_the_pairs(model_dir, write_jsonl, tokenizer, capsys):
    pairs = str(write_jsonl([preference(f"Case {i}.", "Disposition: CLOSE", "Disposition: SAR") for i in range(4)]))
    argv = ["--model", model_dir, "--train", pairs, "--type", "dpo", "--n-epochs", "3", "--batch-size", "2"]
    _, estimate = dry_run(argv, capsys)
    per_epoch = validate_dataset(pairs, tokenizer=tokenizer).n_trained_tokens
    assert estimate["n_trained_tokens_per_epoch"] == per_epoch and estimate["trained_tokens"] == 3 * per_epoch
    assert estimate["n_steps"] == 3 * 2 and estimate["hyperparameters"]["beta"] == 0.1
    assert estimate["trained_tokens_per_second"] > 0 and estimate["estimated_seconds"] > 0


def test_max_steps_scales_the_estimate_to_the_steps_run(model_dir, data, tokenizer, tmp_path):
    run = spec(model_dir, data[0], tmp_path, n_epochs=2, batch_size=2, max_steps=2)  # 2 of 8 steps
    estimate = estimate_run(run, measure=False)
    assert estimate.n_steps == 2
    assert estimate.trained_tokens == round(2 * trained_per_epoch(data[0], tokenizer) * 2 / 8)


def test_bad_input_names_the_flag(model_dir, data, tmp_path, capsys):
    assert main(["finetune", "--dry-run", "--model", model_dir, "--train", str(tmp_path / "none.jsonl")]) == 1
    assert capsys.readouterr().err.strip().endswith(f"--train: file not found: {tmp_path / 'none.jsonl'}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n')
    assert main(["finetune", "--dry-run", "--model", model_dir, "--train", str(bad)]) == 1
    assert "--train: 1 problem(s)" in capsys.readouterr().err
    assert main(["finetune", "--dry-run", "--model", model_dir, "--train", data[0], "--n-epochs", "0"]) == 1
    assert "--n-epochs: " in capsys.readouterr().err
    assert main(["finetune", "--model", model_dir, "--train", data[0]]) == 1
    assert capsys.readouterr().err.strip().endswith("--output: required (unless --dry-run)")
    assert main(["finetune", "--model", model_dir, "--train", data[0], "--output", str(tmp_path), "--no-measure"]) == 1
    assert capsys.readouterr().err.strip().endswith("--no-measure: only applies with --dry-run")


def test_the_command_line_prints_the_tokens_it_trained(model_dir, data, tokenizer, tmp_path, capsys):
    argv = ["finetune", "--model", model_dir, "--train", data[0], "--output", str(tmp_path / "out")]
    assert main([*argv, "--n-epochs", "1", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("succeeded: adapter")
    assert out.strip().endswith(f"trained tokens {trained_per_epoch(data[0], tokenizer):,}")
    # The same count the dry run announced for these settings.
    run = spec(model_dir, data[0], tmp_path, n_epochs=1, batch_size=4)
    assert estimate_run(run, measure=False).trained_tokens == trained_per_epoch(data[0], tokenizer)
