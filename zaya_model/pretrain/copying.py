"""Copying rows: blocks of random tokens, each followed by its repeat, with the loss on the repeats only.

A model predicts a repeat's tokens only by finding the earlier occurrence of the current token and copying what
followed it (an induction head), the skill that copies a value from a case file into an answer. On a small corpus
that skill forms late or never: the loss on such rows stays at ln(vocabulary) for hundreds of steps, then falls
within about 50 (the phase change in which induction heads form), and a copier trained on bank text alone afterwards
forgets it (`benchmarks/RESULTS.md`, "What was tried for copying"). Two pretraining settings use these rows:
- a copying start (`copy_start_steps`): the run first trains on copying rows alone until the model copies;
- copying rows in every batch (`copy_rows`): they keep it copying through the corpus steps.

Blocks are 8 to 32 tokens long, drawn from the tokenizer's ordinary tokens: shorter blocks shorten the plateau
(`benchmarks.copy_probe induction`), and with blocks of up to 64 the start did not copy within 1,500 steps on some
seeds where blocks of up to 32 copied within 900 (`benchmarks/RESULTS.md`, "shorter copying blocks"). A row is BOS
and as many blocks with their repeats as fit, positions from 0. The rows come from a seeded RNG whose state
`state_dict()` saves, so a resumed run draws the same rows.
"""

from __future__ import annotations

import random

import torch

from .corpus import IGNORE_INDEX, as_rng_state

MIN_BLOCK = 8
MAX_BLOCK = 32
MIN_SEQ_LEN = 2 * MIN_BLOCK + 1  # BOS and one block with its repeat
COPIED_LOSS = 1.0  # nats: far below ln(vocabulary), the loss of a model that does not copy
STEPS_AFTER_COPYING = 50  # the copying start goes on this long once the model copies, so the skill settles


class CopyingRows:
    """An endless, seeded, resumable source of copying rows of `seq_len` tokens."""

    def __init__(self, tokenizer, seq_len: int, seed: int):
        if seq_len < MIN_SEQ_LEN:
            raise ValueError(f"copying rows need seq_len >= {MIN_SEQ_LEN}")
        special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        self.tokens = [token for token in range(len(tokenizer)) if token not in special]
        self.bos_token_id = tokenizer.bos_token_id
        self.seq_len = seq_len
        self.max_block = min(MAX_BLOCK, (seq_len - 1) // 2)
        self.rng = random.Random(seed)

    def next_batch(self, rows: int) -> dict[str, torch.Tensor]:
        ids, labels = zip(*(self._row() for _ in range(rows)), strict=True)
        input_ids = torch.tensor(ids, dtype=torch.long)
        return {
            "input_ids": input_ids,
            "position_ids": torch.arange(self.seq_len).expand_as(input_ids).clone(),
            "labels": torch.tensor(labels, dtype=torch.long),
        }

    def _row(self) -> tuple[list[int], list[int]]:
        ids, labels = [self.bos_token_id], [IGNORE_INDEX]
        while len(ids) < self.seq_len:
            block = self.rng.choices(self.tokens, k=self.rng.randint(MIN_BLOCK, self.max_block))
            # The repeat's first token cannot be told from a new block's; each later one can.
            ids += block + block
            labels += [IGNORE_INDEX] * (len(block) + 1) + block[1:]
        return ids[: self.seq_len], labels[: self.seq_len]

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(as_rng_state(state["rng"]))
