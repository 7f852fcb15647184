"""`run_finetune` control: pause then resume, cancel, wall-time cap, early stopping, a failed checkpoint write."""

from __future__ import annotations

import json
import os
import resource
import signal

import peft
import pytest
import torch
from finetune_helpers import Recorder, chat, save_tiny_model, spec, write_data

from finetune.data import read_examples
from finetune.datasets.rendering import tokenize_example
from finetune.run import CheckpointWriteError, run_finetune
from zaya_model import ZayaForCausalLM


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("base"), tokenizer)


@pytest.fixture
def data(write_jsonl):
    return write_data(write_jsonl)


def test_pause_then_resume_equals_an_uninterrupted_run(model_dir, data, tmp_path, tokenizer):
    uninterrupted = Recorder()
    whole = run_finetune(
        spec(model_dir, data[0], tmp_path / "a", n_epochs=2, learning_rate_multiplier=0.625), uninterrupted
    )
    assert len(uninterrupted.losses) == 8  # two epochs of four steps
    # Billed as OpenAI bills: the dataset's trained tokens, once per epoch.
    per_epoch = sum(tokenize_example(example, tokenizer).n_trained for example in read_examples(data[0]))
    assert whole.trained_tokens == 2 * per_epoch == whole.metrics["trained_tokens"]
    assert whole.metrics["trained_tokens_per_second"] > 0

    paused_hooks = Recorder(stop_at=3, request="pause")
    paused = run_finetune(
        spec(model_dir, data[0], tmp_path / "b", n_epochs=2, learning_rate_multiplier=0.625), paused_hooks
    )
    assert paused.status == "paused" and paused.output_dir is None
    [checkpoint] = paused.checkpoints
    assert checkpoint["step"] == 3 and os.path.isfile(os.path.join(checkpoint["path"], "optimizer.pt"))

    resumed_hooks = Recorder()
    resumed = run_finetune(
        spec(model_dir, data[0], tmp_path / "b", n_epochs=2, learning_rate_multiplier=0.625),
        resumed_hooks,
        resume_from=checkpoint["path"],
    )
    assert resumed.status == "succeeded"
    # The resumed run continues the paused run's count: each trained token is billed once per epoch.
    assert 0 < paused.trained_tokens < whole.trained_tokens
    assert resumed.trained_tokens == whole.trained_tokens
    combined = {**paused_hooks.losses, **resumed_hooks.losses}
    assert sorted(combined) == sorted(uninterrupted.losses)
    for step, loss in uninterrupted.losses.items():
        assert combined[step] == pytest.approx(loss, abs=1e-6), step


def test_cancel_stops_without_writing_a_model(model_dir, data, tmp_path):
    hooks = Recorder(stop_at=2, request="cancel")
    result = run_finetune(spec(model_dir, data[0], tmp_path), hooks)
    assert result.status == "cancelled" and result.output_dir is None and result.checkpoints == []
    assert max(hooks.losses) == 2
    assert not (tmp_path / "out" / "final").exists()


def test_wall_time_cap_stops_and_still_writes_the_model(model_dir, data, tmp_path):
    result = run_finetune(spec(model_dir, data[0], tmp_path, max_seconds=1e-3), Recorder())
    assert result.status == "succeeded" and result.metrics["step"] == 1
    assert os.path.isfile(os.path.join(result.output_dir, "adapter_config.json"))


def test_early_stopping_keeps_the_best_checkpoint(model_dir, data, write_jsonl, tmp_path):
    # Validation answers contradict the training answers: the validation loss soon rises and training stops.
    contradicting = [chat(user=f"Case {i}: red flags: none.", answer="Disposition: SAR") for i in range(200, 203)]
    valid = str(write_jsonl(contradicting, "contradicting.jsonl"))
    result = run_finetune(
        spec(
            model_dir,
            data[0],
            tmp_path,
            validation_file=valid,
            max_steps=30,
            eval_every=1,
            early_stopping_patience=2,
            learning_rate_multiplier=1.5625,
        ),
        Recorder(),
    )
    steps = [checkpoint["step"] for checkpoint in result.checkpoints]
    assert result.status == "succeeded" and steps[-1] < 30
    best = min(result.checkpoints, key=lambda checkpoint: checkpoint["metrics"]["valid_loss"])
    assert result.metrics["best_step"] == best["step"] and steps[-1] == best["step"] + 2
    final_weights = peft.utils.load_peft_weights(result.output_dir)
    best_weights = peft.utils.load_peft_weights(best["path"])
    assert all(torch.equal(final_weights[name], best_weights[name]) for name in best_weights)


def test_a_failed_checkpoint_write_leaves_earlier_checkpoints_intact(model_dir, data, tmp_path):
    class FillDiskAfterFirstCheckpoint(Recorder):
        def on_checkpoint(self, step, path, metrics):
            super().on_checkpoint(step, path, metrics)
            resource.setrlimit(resource.RLIMIT_FSIZE, (512, hard_limit))  # files over 512 bytes now fail

    hard_limit = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
    try:
        with pytest.raises(CheckpointWriteError, match="could not write checkpoint checkpoint-4"):
            run_finetune(spec(model_dir, data[0], tmp_path, eval_every=2), FillDiskAfterFirstCheckpoint())
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard_limit, hard_limit))
        signal.signal(signal.SIGXFSZ, previous_handler)
    checkpoints = tmp_path / "out" / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["checkpoint-2"]  # no half-written checkpoint-4, no staging dir
    assert json.loads((checkpoints / "checkpoint-2" / "metrics.json").read_text())["step"] == 2
    peft.PeftModel.from_pretrained(ZayaForCausalLM.from_pretrained(model_dir), checkpoints / "checkpoint-2")


def test_a_non_finite_loss_fails_the_run():
    from transformers import TrainerControl, TrainerState

    from zaya_model.training.callbacks import NonFiniteLossCallback, NonFiniteLossError

    callback, state = NonFiniteLossCallback(), TrainerState(global_step=7)
    callback.on_log(None, state, TrainerControl(), logs={"loss": 2.5})
    with pytest.raises(NonFiniteLossError, match="training loss is nan at step 7"):
        callback.on_log(None, state, TrainerControl(), logs={"loss": float("nan")})
