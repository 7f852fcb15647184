"""Pretraining: the tokenizer trainer (`tokenizer`), streaming corpus packing (`corpus`), presets and the training run
(`train`).

The tokenizer names below are imported on first use, so `zaya --help` (which imports the CLI module) does not load
transformers.
"""

from importlib import import_module
from typing import TYPE_CHECKING

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "END_OF_TURN_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TURN_START_TOKEN",
    "end_of_turn_token_id",
    "generation_eos_token_ids",
    "train_tokenizer",
]

if TYPE_CHECKING:
    from .tokenizer import (
        BOS_TOKEN,
        CHAT_TEMPLATE,
        END_OF_TURN_TOKEN,
        EOS_TOKEN,
        PAD_TOKEN,
        SPECIAL_TOKENS,
        TURN_START_TOKEN,
        end_of_turn_token_id,
        generation_eos_token_ids,
        train_tokenizer,
    )


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(".tokenizer", __name__), name)
    globals()[name] = value
    return value
