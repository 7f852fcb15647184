"""References for the engines' sampling adjustments: OpenAI's penalties as a transformers `LogitsProcessor`
(transformers has processors of its own for the others: `sequence_bias`, `repetition_penalty`, `min_new_tokens`)."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's definition: minus frequency x (times generated so far), minus presence if generated at all."""

    def __init__(self, prompt_length: int, frequency: float, presence: float) -> None:
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_length :]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)
