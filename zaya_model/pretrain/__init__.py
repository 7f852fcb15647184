"""Pretraining pieces: the tokenizer trainer (corpus packing lives beside it)."""

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
