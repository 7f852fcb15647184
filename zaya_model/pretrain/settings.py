"""`PretrainSettings`: everything a pretraining run needs besides its corpus and output directory.

One pydantic model: the presets (`presets.py`) are instances of it, `zaya pretrain`'s flags are generated from it
(`command_line.flags`), every checkpoint saves it, and a bad value is reported under its field's name. Importing it
costs no torch or transformers, so `zaya --help` can list the flags.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

if TYPE_CHECKING:
    from ..configuration_zaya import ZayaConfig

from command_line.flags import Cli

Positive = Annotated[int, Field(ge=1)]


class PretrainSettings(BaseModel):
    """Everything a run needs besides the corpus and the output directory; saved with every checkpoint. `zaya
    pretrain`'s flags are generated from it (`command_line.flags`); a preset gives the values a flag does not."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Annotated[dict[str, Any], Cli(skip=True)] = Field(
        default_factory=dict, description="the ZayaConfig fields of the model shape (all but vocabulary and token ids)"
    )
    tokenizer_vocab_size: Annotated[Positive, Cli(name="vocab-size")] = Field(
        1024, description="vocabulary size of a trained tokenizer"
    )
    tokenizer_split_digits: Annotated[bool, Cli(name="split-digits")] = Field(
        False, description="a trained tokenizer splits numbers into single digits (never merged by BPE)"
    )
    seq_len: Positive = Field(128, description="tokens per packed row")
    batch_size: Positive = Field(8, description="rows per micro-batch")
    grad_accum: Positive = Field(1, description="micro-batches per optimizer step")
    max_steps: Positive = Field(200, description="optimizer steps in total")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="muon: Muon for 2-D hidden weights, AdamW for the rest"
    )
    lr: Annotated[float, Field(gt=0)] = Field(3e-3, description="peak learning rate")
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = Field(0.1, description="final learning rate / peak")
    warmup_steps: Annotated[int, Field(ge=0)] = Field(20, description="linear warmup steps")
    weight_decay: Annotated[float, Field(ge=0)] = Field(0.01, description="AdamW weight decay")
    max_grad_norm: Annotated[float, Field(gt=0)] = Field(1.0, description="gradient clipping norm")
    balancing_lr: Annotated[float, Field(ge=0)] = Field(1e-3, description="router balancing-bias update rate")
    dtype: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto: bf16 autocast on capable accelerators")
    # "none": every rank holds the whole model and optimizer, rank 0 writes `save_pretrained` checkpoints.
    # "fsdp": FSDP2 shards parameters, gradients and optimizer state; every rank writes its shard of each checkpoint
    # (torch.distributed.checkpoint), which any number of processes can resume.
    sharding: Literal["none", "fsdp"] = Field(
        "none", description="fsdp: FSDP2-shard model and optimizer under torchrun, one checkpoint shard per rank"
    )
    seed: int = Field(0, description="seed for initialisation, data order and the validation split")
    validation_fraction: Annotated[float, Field(ge=0, lt=1)] = Field(0.05, description="share of documents held out")
    eval_every: Positive = Field(50, description="steps between validation losses")
    eval_rows: Positive = Field(32, description="validation rows per evaluation")
    save_every: Positive = Field(50, description="steps between checkpoints")
    keep_last: Positive = Field(2, description="checkpoints kept besides the best")
    shuffle_buffer: Positive = Field(256, description="rows in the shuffle buffer")
    packing: Literal["best_fit", "concatenate"] = Field(
        "best_fit",
        description="best_fit: a document that fits in a row is never split (rows padded where none fits); "
        "concatenate: documents end to end, cut every seq_len tokens",
    )
    # Copying rows (`copying.py`): random token blocks, each repeated, loss on the repeats.
    copy_start_steps: Annotated[int, Field(ge=0)] = Field(
        0,
        description="copying start: before the corpus, train on copying rows alone until the model copies (loss "
        "under 1 nat, then 50 steps more), at most this many steps (0: none)",
    )
    copy_start_seq_len: Positive = Field(
        128,
        description="the copying start's row length (at most seq_len): its blocks repeat within 32 tokens, and the "
        "steps it takes hardly depend on the row length, but each step's time does",
    )
    copy_rows: Annotated[int, Field(ge=0)] = Field(
        0, description="rows of each micro-batch that are copying rows instead of corpus rows (keeps the model copying)"
    )
    max_rollbacks: Annotated[int, Field(ge=0)] = Field(
        3, description="rollbacks to the last checkpoint after a non-finite loss before giving up"
    )
    step_timeout_s: Annotated[float, Field(ge=0)] = Field(1800.0, description="a step slower than this fails (0: off)")
    # Not part of a run's identity: a resume may turn it on or off.
    compile: bool = Field(
        False,
        description="run each block's attention, routing and merge as compiled graphs (torch.compile): faster steps "
        "after the first, which compiles",
    )

    @field_validator("seq_len")
    @classmethod
    def _fits_the_model(cls, seq_len: int, info: ValidationInfo) -> int:
        limit = _max_positions(info.data.get("model") or {})
        if seq_len > limit:
            raise PydanticCustomError(
                "too_long", "exceeds the model's max_position_embeddings ({limit})", {"limit": limit}
            )
        return seq_len

    @field_validator("sharding")
    @classmethod
    def _muon_needs_whole_matrices(cls, sharding: str, info: ValidationInfo) -> str:
        if sharding == "fsdp" and info.data.get("optimizer") == "muon":
            # Muon orthogonalises each whole matrix; FSDP hands the optimizer only a row shard of it.
            raise PydanticCustomError("invalid_combination", "fsdp needs optimizer adamw (Muon needs whole matrices)")
        return sharding

    @field_validator("copy_rows")
    @classmethod
    def _leaves_corpus_rows(cls, copy_rows: int, info: ValidationInfo) -> int:
        batch_size = info.data.get("batch_size")
        if batch_size is not None and copy_rows >= batch_size:
            raise PydanticCustomError(
                "too_many", "must be less than batch_size ({batch_size})", {"batch_size": batch_size}
            )
        return copy_rows

    @field_validator("copy_start_steps", "copy_rows")
    @classmethod
    def _rows_hold_a_repeated_block(cls, value: int, info: ValidationInfo) -> int:
        from .copying import MIN_SEQ_LEN

        seq_len = info.data.get("seq_len")
        if value and seq_len is not None and seq_len < MIN_SEQ_LEN:
            raise PydanticCustomError("too_short", "copying rows need seq_len >= {minimum}", {"minimum": MIN_SEQ_LEN})
        return value

    @field_validator("copy_start_seq_len")
    @classmethod
    def _start_rows_hold_a_repeated_block(cls, value: int) -> int:
        from .copying import MIN_SEQ_LEN

        if value < MIN_SEQ_LEN:
            raise PydanticCustomError("too_short", "copying rows need >= {minimum} tokens", {"minimum": MIN_SEQ_LEN})
        return value

    @property
    def max_positions(self) -> int:
        return _max_positions(self.model)

    def replace(self, **changes: Any) -> PretrainSettings:
        """A copy with `changes`, validated like any settings (a pydantic ValidationError names the field)."""
        return PretrainSettings.model_validate({**self.model_dump(), **changes})

    def zaya_config(self, tokenizer) -> ZayaConfig:
        """The model config for a tokenizer: vocabulary rounded up to a multiple of 64 (faster matmuls); generation
        stops at the end of a chat turn too where the tokenizer has one (`train_tokenizer`'s do)."""
        from ..configuration_zaya import ZayaConfig
        from .tokenizer import generation_eos_token_ids

        vocab_size = -(-len(tokenizer) // 64) * 64
        try:
            eos_token_id = generation_eos_token_ids(tokenizer)
        except ValueError:  # a tokenizer without chat turns
            eos_token_id = tokenizer.eos_token_id
        return ZayaConfig(
            **self.model,
            vocab_size=vocab_size,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )


# What a saved ZayaConfig holds besides the shape: the tokenizer's vocabulary and ids, and file bookkeeping.
_NOT_SHAPE = (
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "model_type",
    "transformers_version",
    "architectures",
    "dtype",
)


def model_shape(config: ZayaConfig) -> dict[str, Any]:
    """`config`'s shape as `PretrainSettings.model` holds it: every field but the vocabulary and token ids."""
    return {key: value for key, value in config.to_diff_dict().items() if key not in _NOT_SHAPE}


def _max_positions(model: dict[str, Any]) -> int:
    from ..configuration_zaya import ZayaConfig

    return model.get("max_position_embeddings", ZayaConfig.max_position_embeddings)
