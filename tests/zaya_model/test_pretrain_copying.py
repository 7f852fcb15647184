"""Copying rows in pretraining: their structure, the copying start, copying rows in the batches, exact resume."""

import pytest
import torch
from pretrain_helpers import MICRO, metrics, step_losses, straight_and_resumed
from pydantic import ValidationError
from transformers import PreTrainedTokenizerFast

from zaya_cli.main import main
from zaya_model import ZayaForCausalLM
from zaya_model.pretrain import train as pretrain_train
from zaya_model.pretrain.copying import IGNORE_INDEX, MAX_BLOCK, MIN_BLOCK, CopyingRows
from zaya_model.pretrain.train import Pretrainer
from zaya_model.training.callbacks import TrainingHooks
from zaya_model.training.checkpoint_dirs import latest_checkpoint


def _labelled_runs(labels: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for index, label in enumerate([*labels, IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = index
        elif label == IGNORE_INDEX and start is not None:
            runs.append((start, index))
            start = None
    return runs


def test_rows_are_blocks_and_their_repeats_with_loss_on_what_can_be_copied(tokenizer_dir):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    batch = CopyingRows(tokenizer, seq_len=256, seed=0).next_batch(4)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (4, 256)
    assert (batch["position_ids"] == torch.arange(256)).all()
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist(), strict=True):
        assert ids[0] == tokenizer.bos_token_id and not special & set(ids[1:])
        runs = _labelled_runs(labels)
        assert len(runs) >= 2
        for start, end in runs:
            assert labels[start:end] == ids[start:end]
            if end == len(ids):  # the last repeat may be cut off by the row's end
                continue
            # A repeat of a block of `length` tokens: its first token unlabelled (no way to tell a new block), the
            # rest labelled, each equal to the token `length` positions back.
            length = end - start + 1
            assert MIN_BLOCK <= length <= MAX_BLOCK
            assert ids[start - 1 : end] == ids[start - 1 - length : end - length]
            assert labels[start - 1 - length : start - 1] == [IGNORE_INDEX] * length


def test_rows_follow_the_seed_and_a_saved_state_continues_them(tokenizer_dir, tmp_path):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    rows = CopyingRows(tokenizer, seq_len=64, seed=3)
    rows.next_batch(2)
    torch.save(rows.state_dict(), tmp_path / "state.pt")
    expected = rows.next_batch(2)

    resumed = CopyingRows(tokenizer, seq_len=64, seed=99)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    assert all(torch.equal(value, expected[key]) for key, value in resumed.next_batch(2).items())
    other = CopyingRows(tokenizer, seq_len=64, seed=4)
    other.next_batch(2)
    assert not torch.equal(other.next_batch(2)["input_ids"], expected["input_ids"])


@pytest.mark.parametrize(
    "changes, field, message",
    [
        (dict(batch_size=2, copy_rows=2), "copy_rows", "less than batch_size (2)"),
        (dict(seq_len=16, copy_rows=1), "copy_rows", "seq_len >= 17"),
        (dict(seq_len=16, copy_start_steps=10), "copy_start_steps", "seq_len >= 17"),
        (dict(copy_rows=-1), "copy_rows", "greater than or equal to 0"),
        (dict(copy_start_seq_len=16), "copy_start_seq_len", ">= 17 tokens"),
    ],
)
def test_bad_copying_settings_name_the_field(changes, field, message):
    with pytest.raises(ValidationError) as error:
        MICRO.replace(**changes)
    assert error.value.errors()[0]["loc"] == (field,)
    assert message in str(error.value)


def test_copying_rows_take_the_end_of_each_batch_and_a_resumed_run_draws_the_same(corpus, tokenizer_dir, tmp_path):
    settings = MICRO.replace(batch_size=3, copy_rows=1, copy_start_steps=3)
    batch = Pretrainer(corpus, tmp_path / "batch", settings, tokenizer_path=tokenizer_dir)._next_local_batch()
    assert batch["input_ids"].shape == (3, 32)
    assert (batch["position_ids"][2] == torch.arange(32)).all()  # the copying row: one sequence, positions from 0
    assert (batch["labels"][2] == IGNORE_INDEX).sum() > (batch["labels"][0] == IGNORE_INDEX).sum()

    straight_and_resumed(corpus, tokenizer_dir, tmp_path, settings)  # the resumed run evaluates and saves step 4
    expected, got = step_losses(tmp_path / "straight"), step_losses(tmp_path / "resumed")
    assert sorted(got) == list(range(1, 7))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step
    events = metrics(tmp_path / "resumed")
    assert [e["steps"] for e in events if e.get("event") == "copying_start"] == [3]  # not run again on resume
    evals = [e for e in events if e.get("event") == "eval"]
    assert [e["step"] for e in evals] == [3, 4, 6] and all(e["copying_loss"] > 0 for e in evals)


def test_a_run_without_copying_rows_resumes_from_checkpoints_without_their_state(corpus, tokenizer_dir, tmp_path):
    # Rows too short for a block and its repeat are fine where no copying rows are drawn.
    settings = MICRO.replace(seq_len=12)
    Pretrainer(corpus, tmp_path / "run", settings, tokenizer_path=tokenizer_dir).train(until_step=3)
    state = torch.load(latest_checkpoint(tmp_path / "run" / "checkpoints") / "training_state.pt", weights_only=False)
    assert "copying" not in state
    events = metrics(tmp_path / "run")
    assert not any(e.get("event") == "copying_start" or "copying_loss" in e for e in events)


def test_copying_start_stops_once_the_model_copies_and_reports_it(corpus, tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(pretrain_train, "COPIED_LOSS", 100.0)  # every loss counts as copying: from the 10th step
    settings = MICRO.replace(max_steps=1, copy_start_steps=500)
    seen = []

    class Events(TrainingHooks):
        def on_event(self, level, message, data=None):
            seen.append((level, message))

    Pretrainer(corpus, tmp_path / "run", settings, tokenizer_path=tokenizer_dir, hooks=Events()).train()
    [start] = [e for e in metrics(tmp_path / "run") if e.get("event") == "copying_start"]
    assert start["copying_from"] == 10 and start["steps"] == 10 + pretrain_train.STEPS_AFTER_COPYING
    assert ("info", "copying start: copies from step 10, 60 steps") in seen


def test_copying_start_that_runs_out_warns_and_training_goes_on(corpus, tokenizer_dir, tmp_path):
    seen = []

    class Events(TrainingHooks):
        def on_event(self, level, message, data=None):
            seen.append(level)

    settings = MICRO.replace(copy_start_steps=4)
    result = Pretrainer(corpus, tmp_path / "run", settings, tokenizer_path=tokenizer_dir, hooks=Events()).train()
    assert result.status == "completed" and result.step == settings.max_steps
    [start] = [e for e in metrics(tmp_path / "run") if e.get("event") == "copying_start"]
    assert start["steps"] == 4 and start["copying_from"] is None and start["copying_loss"] > 1.0
    assert "warning" in seen


def test_copying_start_rows_are_copy_start_seq_len_long_and_held_out_rows_seq_len(
    corpus, tokenizer_dir, tmp_path, monkeypatch
):
    shapes = []

    class Recorded(CopyingRows):
        def next_batch(self, rows):
            batch = super().next_batch(rows)
            shapes.append(tuple(batch["input_ids"].shape))
            return batch

    monkeypatch.setattr(pretrain_train, "CopyingRows", Recorded)
    settings = MICRO.replace(seq_len=64, copy_start_seq_len=24, copy_start_steps=3, max_steps=1)
    Pretrainer(corpus, tmp_path / "run", settings, tokenizer_path=tokenizer_dir).train()
    assert shapes.count((settings.batch_size, 24)) == 3  # the start's steps
    assert (settings.batch_size, 64) in shapes and set(shapes) == {(settings.batch_size, 24), (settings.batch_size, 64)}
    shapes.clear()
    longer = MICRO.replace(copy_start_seq_len=128, copy_start_steps=2, max_steps=1)  # capped at seq_len (32)
    Pretrainer(corpus, tmp_path / "capped", longer, tokenizer_path=tokenizer_dir).train()
    assert set(shapes) == {(longer.batch_size, longer.seq_len)}


def test_copying_start_changes_the_model_before_step_zero(corpus, tokenizer_dir, tmp_path):
    plain = Pretrainer(corpus, tmp_path / "plain", MICRO, tokenizer_path=tokenizer_dir)
    started = Pretrainer(corpus, tmp_path / "started", MICRO.replace(copy_start_steps=5), tokenizer_path=tokenizer_dir)
    for trainer in (plain, started):
        trainer.train(until_step=0)
    changed = [
        not torch.equal(a, b)
        for a, b in zip(plain.model.state_dict().values(), started.model.state_dict().values(), strict=True)
    ]
    assert any(changed)
    assert plain.copying_loss() is None and started.copying_loss() > 0  # held-out copying rows only where used


def test_a_stop_during_the_copying_start_saves_nothing_and_a_rerun_starts_over(corpus, tokenizer_dir, tmp_path):
    class PauseAtOnce(TrainingHooks):
        def should_stop(self):
            return "pause"

    settings = MICRO.replace(copy_start_steps=5)
    stopped = Pretrainer(corpus, tmp_path / "run", settings, tokenizer_path=tokenizer_dir, hooks=PauseAtOnce())
    result = stopped.train()
    assert result.status == "interrupted" and result.step == 0
    assert latest_checkpoint(tmp_path / "run" / "checkpoints") is None

    rerun = Pretrainer(corpus, tmp_path / "run", settings, tokenizer_path=tokenizer_dir)
    assert rerun.train().status == "completed"
    straight = Pretrainer(corpus, tmp_path / "straight", settings, tokenizer_path=tokenizer_dir)
    straight.train()
    assert step_losses(tmp_path / "run") == pytest.approx(step_losses(tmp_path / "straight"), abs=1e-6)


def test_cli_cpu_copy_preset_runs_the_copying_start_and_copying_rows(corpus, tmp_path):
    output = tmp_path / "run"
    argv = ["pretrain", "--preset", "cpu-copy", "--data", str(corpus), "--output", str(output), "--no-progress"]
    argv += ["--max-steps", "2", "--copy-start-steps", "3", "--seq-len", "64", "--batch-size", "3"]
    argv += ["--vocab-size", "320", "--eval-every", "2", "--save-every", "2"]
    assert main(argv) == 0
    events = metrics(output)
    assert [e["steps"] for e in events if e.get("event") == "copying_start"] == [3]
    assert [e["step"] for e in events if "copying_loss" in e and e.get("event") == "eval"] == [2]
    state = torch.load(output / "checkpoints" / "checkpoint-2" / "training_state.pt", weights_only=False)
    assert "copying" in state  # the preset's 2 copying rows a batch, their position saved
    config = ZayaForCausalLM.from_pretrained(output).config
    assert (config.hidden_size, config.num_hidden_layers, config.num_experts) == (128, 4, 8)
