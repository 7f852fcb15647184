"""A lower bound of a text's token count from its length alone, so a prompt far over the context is refused without
tokenizing it (an 8 MB prompt takes seconds to tokenize; its length, nothing).

No token of the vocabulary stands for more than `L` characters of its text (the longest vocabulary entry, added
tokens included), so a text of `c` characters takes at least `ceil(c / L)` tokens. That holds when every character
of the text reaches the model, one vocabulary character or more each: no normalizer (which may merge or drop
characters), pre-tokenizers that only split (byte-level, where a character is one to four vocabulary characters,
digits, punctuation, metaspace, splits that keep what they split on) and a BPE model that never fuses unknown
characters into one token. For any other tokenizer there is no bound (`min_tokens` returns 0) and the prompt is
tokenized as usual.
"""

from __future__ import annotations

import json
import math
import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Pre-tokenizers that split text without removing or merging any of its characters (a `Split` may remove its
# pattern: checked by its behaviour).
SPLITTING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Digits", "Punctuation", "Metaspace", "UnicodeScripts"})
KEEPING_SPLIT_BEHAVIOURS = frozenset({"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"})

_longest_token: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def min_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """At least as many tokens as `text` encodes to (without special tokens); 0 where no sound bound is known."""
    longest = longest_token_chars(tokenizer)
    return math.ceil(len(text) / longest) if longest else 0


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The characters of the tokenizer's longest vocabulary entry, or 0 if its length bound does not hold (computed
    once per tokenizer)."""
    with _lock:
        if tokenizer in _longest_token:
            return _longest_token[tokenizer]
    longest = _longest_token_chars(tokenizer)
    with _lock:
        _longest_token[tokenizer] = longest
    return longest


def _longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return 0
    try:
        description = json.loads(backend.to_str())
    except (ValueError, TypeError):
        return 0
    if not _keeps_every_character(description):
        return 0
    vocabulary = tokenizer.get_vocab()
    return max((len(token) for token in vocabulary), default=0)


def _keeps_every_character(description: dict[str, Any]) -> bool:
    """Every character of a text reaches the model as at least one vocabulary character."""
    if description.get("normalizer") is not None:
        return False
    model = description.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and model.get("unk_token") is not None):
        return False
    return _only_splits(description.get("pre_tokenizer"))


def _only_splits(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_only_splits(each) for each in pre_tokenizer.get("pretokenizers", []))
    if kind == "Split":
        return pre_tokenizer.get("behavior") in KEEPING_SPLIT_BEHAVIOURS
    return kind in SPLITTING_PRE_TOKENIZERS
