"""Record builders and fine-tuning helpers shared by the tests under tests/finetune (a module here, beside
`tiny_models.py`, because a `tests/finetune` package would shadow the real `finetune`)."""

from __future__ import annotations

import torch
from tiny_models import TINY_ZAYA, randomize_zaya

from finetune.run import FineTuneRun, TrainingHooks
from finetune.settings import FineTuneSettings
from zaya_model import ZayaConfig, ZayaForCausalLM


def chat(user="Summarise case 1.", answer="Disposition: CLOSE", **extra):
    return {
        "messages": [
            {"role": "system", "content": "You are an investigator."},
            {"role": "user", "content": user},
            {"role": "assistant", "content": answer, **extra},
        ]
    }


def preference(user="Summarise case 1.", preferred="Disposition: CLOSE", non_preferred="Disposition: SAR"):
    """One line of OpenAI's preference (DPO) format."""
    return {
        "input": {
            "messages": [{"role": "system", "content": "You are an investigator."}, {"role": "user", "content": user}]
        },
        "preferred_output": [{"role": "assistant", "content": preferred}],
        "non_preferred_output": [{"role": "assistant", "content": non_preferred}],
    }


LABELS = ("CLOSE", "ESCALATE", "SAR")


def bank_chats(n, offset=0):
    """Short disposition chats whose label follows from the number of red flags (0, 1, 2+)."""
    flags = ["structuring", "rapid movement", "high-risk wire"]
    records = []
    for index in range(offset, offset + n):
        count = index % 3
        user = f"Case {index}: red flags: {', '.join(flags[:count]) or 'none'}."
        records.append(chat(user=user, answer=f"Disposition: {LABELS[count]}"))
    return records


def save_tiny_model(directory, tokenizer):
    torch.manual_seed(0)
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    randomize_zaya(ZayaForCausalLM(ZayaConfig(**{**TINY_ZAYA, "vocab_size": len(tokenizer), **ids}))).save_pretrained(
        directory
    )
    tokenizer.save_pretrained(directory)
    return str(directory)


def write_data(write_jsonl):
    return str(write_jsonl(bank_chats(8), "train.jsonl")), str(write_jsonl(bank_chats(3, offset=100), "valid.jsonl"))


class Recorder(TrainingHooks):
    def __init__(self, stop_at=None, request=None):
        self.stop_at, self.request = stop_at, request
        self.losses, self.events, self.checkpoints, self.polls = {}, [], [], 0

    def on_event(self, level, message, data=None):
        self.events.append((level, message))

    def on_metrics(self, step, metrics):
        if "train_loss" in metrics:
            self.losses[step] = metrics["train_loss"]

    def on_checkpoint(self, step, path, metrics):
        self.checkpoints.append((step, path, metrics))

    def should_stop(self):  # polled once per optimizer step
        self.polls += 1
        return self.request if self.stop_at is not None and self.polls >= self.stop_at else None


def spec(model_dir, train, tmp_path, *, validation_file=None, seed=0, **options):
    """A run into tmp_path/out; `options` are `zaya finetune`'s flag names (`method="full"`, `lora_r=4`, ...)."""
    settings = FineTuneSettings.from_options(**{"batch_size": 2, "n_epochs": 3, **options})
    return FineTuneRun(
        model_dir=model_dir,
        train_file=train,
        output_dir=str(tmp_path / "out"),
        validation_file=validation_file,
        seed=seed,
        settings=settings,
    )
