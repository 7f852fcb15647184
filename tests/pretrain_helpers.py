"""Pretraining test helpers shared by tests/zaya_model: the micro model's settings, the synthetic case corpus and its
tokenizer, metrics readers, and a gloo rank that trains (importable by forked and spawned processes)."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

from finetune.datasets.synthetic import generate_cases, render_case_file
from zaya_model.pretrain.presets import MICRO_MODEL, PretrainSettings
from zaya_model.pretrain.tokenizer import train_tokenizer
from zaya_model.pretrain.train import Pretrainer

MICRO = PretrainSettings(
    model=MICRO_MODEL,
    tokenizer_vocab_size=320,
    seq_len=32,
    batch_size=2,
    max_steps=6,
    lr=1e-2,
    warmup_steps=2,
    dtype="fp32",
    eval_every=3,
    eval_rows=4,
    save_every=3,
    keep_last=2,
    shuffle_buffer=8,
    step_timeout_s=0,
)


def straight_and_resumed(corpus, tokenizer_dir, tmp_path, settings, resumed_settings=None):
    """Trainers of one run trained straight through (in `straight`) and of the same run stopped after step 4 and
    resumed by a new trainer (in `resumed`, with `resumed_settings` when given), both trained to the end."""
    straight = Pretrainer(corpus, tmp_path / "straight", settings, tokenizer_path=tokenizer_dir)
    straight.train()
    resumed_settings = resumed_settings or settings
    first = Pretrainer(corpus, tmp_path / "resumed", resumed_settings, tokenizer_path=tokenizer_dir)
    assert first.train(until_step=4).status == "completed"
    assert first.step == 4
    resumed = Pretrainer(corpus, tmp_path / "resumed", resumed_settings, tokenizer_path=tokenizer_dir)
    assert resumed.step == 4
    resumed.train()
    return straight, resumed


def write_case_corpus(path: Path) -> Path:
    texts = [render_case_file(case) for case in generate_cases(120, seed=5)]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def save_corpus_tokenizer(corpus: Path, directory: Path) -> Path:
    texts = (json.loads(line)["text"] for line in corpus.read_text().splitlines())
    train_tokenizer(texts, vocab_size=320).save_pretrained(directory)
    return directory


def metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def step_losses(output: Path) -> dict[int, float]:
    """The loss of every step (a step redone after a resume or rollback keeps its last value)."""
    return {m["step"]: m["loss"] for m in metrics(output) if "loss" in m}


def train_rank(rank, world_size, init_file, corpus, output, settings, tokenizer_dir, until_step):
    import torch.distributed as dist

    from zaya_model.training.distributed import DistributedContext

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        context = DistributedContext(rank, world_size)
        trainer = Pretrainer(corpus, output, settings, tokenizer_path=tokenizer_dir, distributed=context)
        trainer.train(until_step=until_step)
    except BaseException:
        Path(f"{init_file}.rank{rank}.error").write_text(traceback.format_exc())  # shown by the test
        raise
    finally:
        dist.destroy_process_group()
