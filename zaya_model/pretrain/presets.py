"""Pretraining presets: a model shape plus the training settings that suit it.

`tiny` trains on 2 CPU cores in a minute or two (a few million parameters, short rows); `zaya1-base` is the full
ZAYA1-base shape (`ZayaConfig.zaya1_base()`) with settings in the spirit of its pretraining (Muon + AdamW, long
warmup, 4k rows), meant for an accelerator cluster. The model's vocabulary follows the tokenizer, so `model` holds
every `ZayaConfig` field except the token ids and vocabulary size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..configuration_zaya import ZayaConfig


@dataclass(frozen=True)
class PretrainSettings:
    """Everything a run needs besides the corpus and the output directory; saved with every checkpoint."""

    model: dict[str, Any] = field(default_factory=dict)
    tokenizer_vocab_size: int = 1024
    seq_len: int = 128
    batch_size: int = 8
    grad_accum: int = 1
    max_steps: int = 200
    optimizer: str = "adamw"  # "adamw" or "muon" (Muon for 2-D hidden weights, AdamW for the rest)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    balancing_lr: float = 1e-3
    dtype: str = "auto"  # "auto" (bf16 autocast on accelerators that support it), "fp32" or "bf16"
    # "none": every rank holds the whole model and optimizer, rank 0 writes `save_pretrained` checkpoints.
    # "fsdp": FSDP2 shards parameters, gradients and optimizer state; every rank writes its shard of each checkpoint
    # (torch.distributed.checkpoint), which any number of processes can resume.
    sharding: str = "none"
    seed: int = 0
    validation_fraction: float = 0.05
    eval_every: int = 50
    eval_rows: int = 32
    save_every: int = 50
    keep_last: int = 2
    shuffle_buffer: int = 256
    max_rollbacks: int = 3
    step_timeout_s: float = 1800.0
    # Each block's attention, routing and expert merge as compiled graphs (`ZayaForCausalLM.enable_compiled_layers`):
    # faster steps once the first has compiled. Not part of a run's identity: a resume may turn it on or off.
    compile: bool = False

    def __post_init__(self):
        for name in ("tokenizer_vocab_size", "seq_len", "batch_size", "grad_accum", "max_steps", "eval_every",
                     "eval_rows", "save_every", "keep_last", "shuffle_buffer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.validation_fraction < 1:
            raise ValueError(f"validation_fraction must be in [0, 1), got {self.validation_fraction}")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be adamw or muon, not {self.optimizer!r}")
        if self.dtype not in ("auto", "fp32", "bf16"):
            raise ValueError(f"dtype must be auto, fp32 or bf16, not {self.dtype!r}")
        if self.sharding not in ("none", "fsdp"):
            raise ValueError(f"sharding must be none or fsdp, not {self.sharding!r}")
        if self.sharding == "fsdp" and self.optimizer == "muon":
            # Muon orthogonalises each whole matrix; FSDP hands the optimizer only a row shard of it.
            raise ValueError("optimizer muon needs whole weight matrices; use --optimizer adamw with --sharding fsdp")
        if self.warmup_steps < 0 or self.lr <= 0:
            raise ValueError("warmup_steps must be >= 0 and lr > 0")
        if self.seq_len > self.max_positions:
            raise ValueError(
                f"seq_len {self.seq_len} exceeds the model's max_position_embeddings ({self.max_positions})"
            )

    @property
    def max_positions(self) -> int:
        return self.model.get("max_position_embeddings", ZayaConfig.max_position_embeddings)

    def replace(self, **changes: Any) -> PretrainSettings:
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown pretraining settings: {sorted(unknown)}")
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def model_config(self, tokenizer) -> ZayaConfig:
        """The model config for a tokenizer: vocabulary rounded up to a multiple of 64 (faster matmuls)."""
        vocab_size = -(-len(tokenizer) // 64) * 64
        return ZayaConfig(
            **self.model,
            vocab_size=vocab_size,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )


_ZAYA1_BASE_SHAPE = {
    key: value
    for key, value in ZayaConfig.zaya1_base().to_diff_dict().items()
    if key not in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "model_type", "transformers_version")
}

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

PRESETS: dict[str, PretrainSettings] = {
    "tiny": PretrainSettings(
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
