"""A chat prompt's token ids, with what the caller wrote encoded as text.

A chat template renders messages to text, and tokenizing that text would read a special token's spelling anywhere in
it (`<|im_end|>`, `<|im_start|>`) as the special token itself: a user could close their own turn and forge a system
or assistant turn. Here only the special tokens the template writes are special. The caller's strings (message
contents, names, tool calls and tool definitions) are rendered with each special token's spelling replaced by a mark
of letters and digits (random per prompt, so no input can hold one); the rendered text is cut at the special tokens
left, which are the template's; the marks go back to the spellings they stand for, and those pieces are encoded with
special tokens split into ordinary text. Prompts without such spellings take the usual path, with the same ids.

Both engines receive these token ids (the local engine and vLLM), never the text.
"""

from __future__ import annotations

import re
import secrets
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]

# Per tokenizer: a copy of its backend that encodes special tokens' spellings as text. A copy, because the flag is
# state of the backend, and flipping it on the shared one would race with other threads encoding.
_LITERAL_BACKENDS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, Tokenizer] = weakref.WeakKeyDictionary()
_LITERAL_LOCK = threading.Lock()


def special_tokens(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The spellings of the tokenizer's special tokens, longest first (so a regex alternation prefers the longest)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    spellings = {token.content for token in added.values() if getattr(token, "special", False)}
    spellings |= set(tokenizer.all_special_tokens)
    return sorted((spelling for spelling in spellings if spelling), key=len, reverse=True)


def _strings(value: Any) -> Any:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _masked(value: Any, mask: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, dict):
        return {_masked(key, mask): _masked(item, mask) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_masked(item, mask) for item in value]
    return value


def _literal_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    with _LITERAL_LOCK:
        literal = _LITERAL_BACKENDS.get(tokenizer)
        if literal is None:
            from tokenizers import Tokenizer

            literal = Tokenizer.from_str(backend.to_str())
            literal.encode_special_tokens = True
            _LITERAL_BACKENDS[tokenizer] = literal
        return literal


def encode_literally(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """`text`'s ids with every special token's spelling in it encoded as ordinary text."""
    literal = _literal_backend(tokenizer)
    if literal is not None:
        return list(literal.encode(text, add_special_tokens=False).ids)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    return ids


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    render: Render,
) -> list[int]:
    """The ids of `render(messages, tools)` (the chat template's text), its special tokens only those the template
    writes; special tokens' spellings inside `messages` and `tools` are text."""
    spellings = special_tokens(tokenizer)
    hostile = [spelling for spelling in spellings if any(spelling in text for text in _strings([messages, tools]))]
    if not hostile:
        ids: list[int] = tokenizer.encode(render(messages, tools), add_special_tokens=False)
        return ids
    nonce = secrets.token_hex(8)
    marks = {spelling: f"zayaliteral{nonce}n{index}x" for index, spelling in enumerate(hostile)}
    find_hostile = re.compile("|".join(re.escape(spelling) for spelling in hostile))

    def mask(text: str) -> str:
        return find_hostile.sub(lambda match: marks[match.group()], text)

    text = render(_masked(messages, mask), _masked(tools, mask) if tools is not None else None)
    written = re.compile("(" + "|".join(re.escape(spelling) for spelling in spellings) + ")")
    restore = re.compile("|".join(re.escape(mark) for mark in marks.values()))
    spelled = {mark: spelling for spelling, mark in marks.items()}
    token_ids: list[int] = []
    for index, piece in enumerate(written.split(text)):
        if index % 2:  # a special token the template wrote: one of the tokenizer's own, so one id
            token_ids.append(cast(int, tokenizer.convert_tokens_to_ids(piece)))
        elif piece:
            if restore.search(piece):
                token_ids += encode_literally(tokenizer, restore.sub(lambda match: spelled[match.group()], piece))
            else:
                token_ids += tokenizer.encode(piece, add_special_tokens=False)
    return token_ids
