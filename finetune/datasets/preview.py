"""Show how one example is rendered and which of its tokens are trained (the loss mask)."""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .formats import Example, parse_record
from .rendering import tokenize_example

if TYPE_CHECKING:  # transformers is slow to import; only the type is needed here
    from transformers import PreTrainedTokenizerBase

# Trained spans in the text view; chosen because they hardly ever occur in bank data.
TRAINED_OPEN, TRAINED_CLOSE = "⟦", "⟧"


@dataclass(frozen=True)
class PreviewToken:
    id: int
    text: str
    trained: bool


@dataclass(frozen=True)
class PreviewSegment:
    """A run of consecutive tokens that are all trained or all not."""

    text: str
    trained: bool
    n_tokens: int


@dataclass(frozen=True)
class Preview:
    format: str
    tokens: list[PreviewToken]
    segments: list[PreviewSegment]

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_trained_tokens(self) -> int:
        return sum(token.trained for token in self.tokens)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "n_tokens": self.n_tokens, "n_trained_tokens": self.n_trained_tokens}

    def to_text(self) -> str:
        body = "".join(
            f"{TRAINED_OPEN}{segment.text}{TRAINED_CLOSE}" if segment.trained else segment.text
            for segment in self.segments
        )
        header = (
            f"format: {self.format} | tokens: {self.n_tokens} | trained: {self.n_trained_tokens} "
            f"(trained text is inside {TRAINED_OPEN} {TRAINED_CLOSE})"
        )
        return f"{header}\n{body}"


def preview_example(example: Example, tokenizer: PreTrainedTokenizerBase) -> Preview:
    from zaya_model.pretrain.tokenizer import decode_text  # imports transformers, as the tokenizer given has

    tokenized = tokenize_example(example, tokenizer)
    tokens = [
        PreviewToken(token_id, decode_text(tokenizer, [token_id]), bool(trained))
        for token_id, trained in zip(tokenized.input_ids, tokenized.trained_mask, strict=True)
    ]
    segments: list[PreviewSegment] = []
    start = 0
    for end in range(1, len(tokens) + 1):
        if end == len(tokens) or tokens[end].trained != tokens[start].trained:
            ids = tokenized.input_ids[start:end]
            segments.append(PreviewSegment(decode_text(tokenizer, ids), tokens[start].trained, len(ids)))
            start = end
    return Preview(example.format.value, tokens, segments)


def preview_line(path: str | os.PathLike[str], line: int, tokenizer: PreTrainedTokenizerBase) -> Preview:
    """Preview the example on 1-based `line` of a JSONL file (read by streaming up to that line)."""
    if line < 1:
        raise ValueError("line numbers start at 1")
    with open(path, "rb") as file:
        raw = next(itertools.islice(file, line - 1, None), None)
    if raw is None:
        raise ValueError(f"{os.fspath(path)} has fewer than {line} lines")
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"line {line}: invalid UTF-8") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"line {line}: invalid JSON: {error.msg}") from None
    example, problems = parse_record(record)
    if example is None:
        raise ValueError(f"line {line}: " + "; ".join(f"{p.field or 'record'}: {p.message}" for p in problems))
    return preview_example(example, tokenizer)
