"""Tokenized fine-tuning data for the Trainer: examples with assistant-only labels, and the batch collators.

Labels come from `tokenize_example` (the one place that decides trained tokens): the token id where the mask is 1,
-100 elsewhere. With packing, `PackingCollator` places a batch's examples into rows no longer than its longest
example, each row concatenated as `DataCollatorWithFlattening` does: `position_ids` restart at 0 for each example, so
the model masks attention, convolutions and the value shift per example, and each example's first label is -100, so
no example predicts or sees another's tokens. Bounding the rows matters: attention over a row costs the square of its
length, so one row holding a whole batch of chats trains far slower per token than rows of one chat's length.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, PreTrainedTokenizerBase

from .datasets.formats import Example, parse_record
from .datasets.rendering import tokenize_example

IGNORE_INDEX = -100


def read_examples(path: str | os.PathLike[str]) -> list[Example]:
    """Parse every line of an already validated JSONL file."""
    examples = []
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            example, problems = parse_record(json.loads(line))
            if example is None:  # validate_dataset ran first, so this means the file changed under us
                raise ValueError(f"{path}: line {line_number}: {problems[0].message}")
            examples.append(example)
    return examples


def labelled_features(example: Example, tokenizer: PreTrainedTokenizerBase) -> dict[str, list[int]]:
    tokenized = tokenize_example(example, tokenizer)
    pairs = zip(tokenized.input_ids, tokenized.trained_mask, strict=True)
    labels = [token if trained else IGNORE_INDEX for token, trained in pairs]
    return {"input_ids": tokenized.input_ids, "labels": labels}


class TokenizedDataset(torch.utils.data.Dataset[dict[str, list[int]]]):
    """Examples tokenized once, up front (fine-tuning sets are small; this keeps epochs and resumes cheap)."""

    def __init__(self, examples: list[Example], tokenizer: PreTrainedTokenizerBase):
        self.features = [labelled_features(example, tokenizer) for example in examples]

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.features[index]

    @property
    def n_trained_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for feature in self.features for label in feature["labels"])


class PackingCollator:
    """Examples packed first-fit, longest first, into rows of at most the batch's longest example; rows padded at the
    end with `pad_token_id` (a document of its own, label -100) to one length."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id
        self.flatten = DataCollatorWithFlattening(return_tensors="pt")

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        limit = max(len(feature["input_ids"]) for feature in features)
        rows: list[list[dict[str, list[int]]]] = []
        lengths: list[int] = []
        for feature in sorted(features, key=lambda feature: -len(feature["input_ids"])):
            size = len(feature["input_ids"])
            row = next((index for index, used in enumerate(lengths) if used + size <= limit), None)
            if row is None:
                rows.append([])
                lengths.append(0)
                row = len(rows) - 1
            rows[row].append(feature)
            lengths[row] += size
        packed = [self.flatten(row) for row in rows]
        batch = {}
        for key, pad in (("input_ids", self.pad_token_id), ("labels", IGNORE_INDEX), ("position_ids", None)):
            batch[key] = torch.cat([_pad_row(row[key], limit, pad) for row in packed])
        return batch


def _pad_row(row: torch.Tensor, length: int, pad: int | None) -> torch.Tensor:
    missing = length - row.shape[1]
    if missing == 0:
        return row
    filler = torch.arange(missing)[None] if pad is None else torch.full((1, missing), pad, dtype=row.dtype)
    return torch.cat([row, filler.to(row.dtype)], dim=1)


def make_collator(
    tokenizer: PreTrainedTokenizerBase, packing: bool
) -> Callable[[list[dict[str, list[int]]]], dict[str, Any]]:
    if packing:
        return PackingCollator(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")


def token_statistics(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token (negative log-likelihood, correct) for the next-token prediction at each position, shape
    (batch, seq - 1, 2); positions whose target label is -100 are 0. Sum them and count the trained labels to get
    the token-weighted loss and mean token accuracy."""
    logits, targets = logits[:, :-1].float(), labels[:, 1:]
    trained = targets != IGNORE_INDEX
    safe_targets = targets.clamp_min(0)
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), safe_targets, reduction="none")
    correct = (logits.argmax(-1) == safe_targets).float()
    return torch.stack([nll * trained, correct * trained], dim=-1)
