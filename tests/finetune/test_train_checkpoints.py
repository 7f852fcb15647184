"""Full fine-tuning's balancing-bias update (LoRA leaves the biases alone) and checkpoint rotation."""

from __future__ import annotations

import os

import peft
import pytest
import torch
from finetune_helpers import Recorder, chat, save_tiny_model, spec, write_data

from finetune.balancing_callback import BALANCING_STATE_FILE, BalancingBiasCallback
from finetune.run import run_finetune
from zaya_model import ZayaForCausalLM
from zaya_model.training.checkpoint_dirs import rotate_checkpoints


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("base"), tokenizer)


@pytest.fixture
def data(write_jsonl):
    return write_data(write_jsonl)


def biases(model):
    return torch.stack([layer.mlp.gate.balancing_biases for layer in model.model.layers])


class DeletionRecorder(Recorder):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.deleted = []

    def on_checkpoint_deleted(self, step, path):
        assert not os.path.exists(path)
        self.deleted.append(step)


def test_the_balancing_step_lowers_the_most_used_experts_bias(model_dir, tokenizer):
    model = ZayaForCausalLM.from_pretrained(model_dir).train()
    callback = BalancingBiasCallback(model, lr=1e-2)
    before = biases(model).clone()
    model(torch.randint(3, len(tokenizer), (2, 24)))  # a training forward counts the routed tokens
    counts = [layer.mlp.gate.routed_token_counts[:-1].clone() for layer in model.model.layers]
    callback.on_step_end(None, None, None)
    change = biases(model) - before
    for layer, layer_counts in enumerate(counts):
        assert change[layer, layer_counts.argmax()] < 0 < change[layer, layer_counts.argmin()]
        assert change[layer, -1] == 0  # the skip class is not balanced
    assert callback.last_stats["max_load_imbalance"] >= 1.0


def test_full_fine_tuning_updates_the_biases_and_resumes_them_exactly(model_dir, data, tmp_path):
    settings = dict(method="full", n_epochs=2, learning_rate_multiplier=0.625, balancing_bias_lr=1e-2)
    uninterrupted = run_finetune(spec(model_dir, data[0], tmp_path / "a", **settings), Recorder())
    base = biases(ZayaForCausalLM.from_pretrained(model_dir))
    trained = biases(ZayaForCausalLM.from_pretrained(uninterrupted.output_dir))
    assert (trained - base)[:, :-1].abs().min() > 1e-3  # every expert's bias moved
    assert torch.equal(trained[:, -1], base[:, -1])

    paused = run_finetune(spec(model_dir, data[0], tmp_path / "b", **settings), Recorder(stop_at=3, request="pause"))
    [checkpoint] = paused.checkpoints
    assert os.path.isfile(os.path.join(checkpoint["path"], BALANCING_STATE_FILE))
    resumed = run_finetune(
        spec(model_dir, data[0], tmp_path / "b", **settings), Recorder(), resume_from=checkpoint["path"]
    )
    again = biases(ZayaForCausalLM.from_pretrained(resumed.output_dir))
    assert torch.allclose(again, trained, atol=1e-6)  # the updater's AdamW state came back with the checkpoint


def test_lora_leaves_the_balancing_biases_of_the_base_model(model_dir, data, tmp_path):
    result = run_finetune(
        spec(model_dir, data[0], tmp_path, max_steps=3, learning_rate_multiplier=0.625, merge_adapter=True), Recorder()
    )
    merged = ZayaForCausalLM.from_pretrained(result.output_dir)
    assert torch.equal(biases(merged), biases(ZayaForCausalLM.from_pretrained(model_dir)))
    adapter_dir = tmp_path / "out" / "final"
    assert not any("balancing" in name for name in peft.utils.load_peft_weights(str(adapter_dir)))


def test_rotation_keeps_the_newest_checkpoints_and_the_best(model_dir, data, write_jsonl, tmp_path):
    # Validation answers contradict the training answers: the validation loss bottoms out early, then rises.
    contradicting = [chat(user=f"Case {i}: red flags: none.", answer="Disposition: SAR") for i in range(200, 203)]
    valid = str(write_jsonl(contradicting, "contradicting.jsonl"))
    hooks = DeletionRecorder()
    result = run_finetune(
        spec(
            model_dir,
            data[0],
            tmp_path,
            validation_file=valid,
            max_steps=12,
            eval_every=1,
            keep_checkpoints=2,
            learning_rate_multiplier=3.125,
        ),
        hooks,
    )
    best = result.metrics["best_step"]
    assert best < 11  # otherwise the best would be one of the newest two and the test would prove less
    kept = sorted({best, 11, 12})
    checkpoints = tmp_path / "out" / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == sorted(f"checkpoint-{step}" for step in kept)  # nothing hidden left
    assert sorted(hooks.deleted) == [step for step in range(1, 13) if step not in kept]
    assert [c["step"] for c in result.checkpoints] == kept
    # load_best_model_at_end found the best checkpoint: the final adapter is its weights.
    final_weights = peft.utils.load_peft_weights(result.output_dir)
    best_weights = peft.utils.load_peft_weights(str(checkpoints / f"checkpoint-{best}"))
    assert all(torch.equal(final_weights[name], best_weights[name]) for name in best_weights)


def test_rotation_finishes_an_interrupted_delete(tmp_path):
    for step in (1, 2, 3):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / ".checkpoint-0.deleting").mkdir()  # a crash in the middle of an earlier delete
    assert rotate_checkpoints(tmp_path, keep_last=1, best_step=1) == [2]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-3"]
