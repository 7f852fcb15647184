"""The model `zaya run` bootstraps: the `bootstrap` pretraining preset, trained by the pretrainer on rendered chats."""

import torch
from transformers import AutoTokenizer

from finetune.bootstrap import build_tiny_model
from finetune.datasets.synthetic import generate_chat_examples
from zaya_model import ZayaForCausalLM
from zaya_model.pretrain import generation_eos_token_ids
from zaya_model.pretrain.presets import get_preset


def chat_loss(directory, conversations) -> float:
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = ZayaForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        losses = []
        for conversation in conversations:
            ids = tokenizer.apply_chat_template(conversation, return_tensors="pt", return_dict=True)["input_ids"]
            losses.append(model(input_ids=ids, labels=ids).loss.item())
    return sum(losses) / len(losses)


def test_the_bootstrap_model_is_the_preset_pretrained_on_chats(tmp_path):
    once = build_tiny_model(tmp_path / "once", train_steps=1)
    trained = build_tiny_model(tmp_path / "trained", train_steps=40)

    preset = get_preset("bootstrap")
    model = ZayaForCausalLM.from_pretrained(trained)
    tokenizer = AutoTokenizer.from_pretrained(trained)
    for key, value in preset.model.items():
        assert getattr(model.config, key) == value, key
    assert tokenizer.model_max_length == preset.max_positions
    # Chat answers stop at the end of the turn.
    assert model.generation_config.eos_token_id == generation_eos_token_ids(tokenizer)
    # Nothing but the model and its tokenizer: the pretraining run's checkpoints and logs stay behind.
    assert {path.name for path in trained.iterdir()} == {path.name for path in once.iterdir()}
    assert not {"checkpoints", "run.json", "metrics.jsonl", "tokenizer"} & {path.name for path in trained.iterdir()}

    held_out = [example["messages"] for example in generate_chat_examples(8, seed=99)]
    assert chat_loss(trained, held_out) < 0.8 * chat_loss(once, held_out)
