"""The tiny model `zaya run` bootstraps when no model is registered: the `bootstrap` pretraining preset, trained by the
pretrainer on synthetic bank chats rendered with the chat template, so its first answers already read like a bank's.
The demo and the tests start from it too.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

BOOTSTRAP_PRESET = "bootstrap"
BOOTSTRAP_CONVERSATIONS = 90


def build_tiny_model(output_dir: Path, *, train_steps: int | None = None, seed: int = 0) -> Path:
    """Train a tokenizer and a tiny ZAYA model (`train_steps` pretraining steps, the preset's by default) on synthetic
    bank chats; write both to `output_dir` atomically."""
    from finetune.datasets.synthetic import generate_chat_examples
    from zaya_model import ZayaForCausalLM
    from zaya_model.pretrain import train_tokenizer
    from zaya_model.pretrain.presets import get_preset
    from zaya_model.pretrain.train import Pretrainer
    from zaya_model.training.atomic_io import atomic_directory

    settings = get_preset(BOOTSTRAP_PRESET).replace(seed=seed)
    if train_steps is not None:
        settings = settings.replace(max_steps=train_steps)
    conversations = [example["messages"] for example in generate_chat_examples(BOOTSTRAP_CONVERSATIONS, seed=seed)]
    plain_text = ("\n".join(message["content"] for message in conversation) for conversation in conversations)
    # Trained here rather than by the pretrainer: the corpus is the chats rendered with this tokenizer's template,
    # so that the template's turn tokens are trained like any other.
    tokenizer = train_tokenizer(plain_text, vocab_size=settings.tokenizer_vocab_size)
    with tempfile.TemporaryDirectory(prefix="zaya-bootstrap-") as temporary:
        workdir = Path(temporary)
        tokenizer.save_pretrained(workdir / "tokenizer")
        corpus = workdir / "chats.jsonl"
        with corpus.open("w") as handle:
            for conversation in conversations:
                # The packer puts BOS before each document itself.
                text = tokenizer.apply_chat_template(conversation, tokenize=False)
                if not isinstance(text, str):
                    raise TypeError(f"apply_chat_template(tokenize=False) gave a {type(text).__name__}")
                text = text.removeprefix(tokenizer.bos_token)
                handle.write(json.dumps({"text": text}) + "\n")
        run = workdir / "run"
        Pretrainer(corpus, run, settings, tokenizer_path=workdir / "tokenizer").train()
        model = ZayaForCausalLM.from_pretrained(run)
        trained_tokenizer = type(tokenizer).from_pretrained(run)
        with atomic_directory(output_dir) as staging:
            model.save_pretrained(staging)
            trained_tokenizer.save_pretrained(staging)
    return output_dir
