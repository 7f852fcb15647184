"""Tokenized fine-tuning data for the Trainer: examples with assistant-only labels, and the batch collators.

Labels come from `tokenize_example` (the one place that decides trained tokens): the token id where the mask is 1,
-100 elsewhere. With packing, `DataCollatorWithFlattening` concatenates a batch into one row whose `position_ids`
restart at 0 for each example; the model masks attention, convolutions and the value shift per example, and the
collator puts -100 on each example's first label, so no example predicts or sees another's tokens.
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


class TokenizedDataset(torch.utils.data.Dataset):
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


def make_collator(tokenizer: PreTrainedTokenizerBase, packing: bool) -> Callable[[list[dict]], dict[str, Any]]:
    if packing:
        return DataCollatorWithFlattening(return_tensors="pt")
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
