"""Choosing the next token of one sequence: greedy, or temperature + nucleus (top-p) sampling with its own RNG."""

from __future__ import annotations

import secrets

import torch

from server.engines.base import SamplingParams


def choice_generator(seed: int | None, choice_index: int) -> torch.Generator:
    """An RNG per choice: the same seed gives the same choices whatever else shares the batch."""
    if seed is None:
        return torch.Generator().manual_seed(secrets.randbits(63))
    # Distinct, reproducible streams for the n choices of one seeded request.
    return torch.Generator().manual_seed((seed * 1_000_003 + choice_index) % 2**63)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """`logits`: the next-token logits of one sequence, shape [vocab]."""
    if params.greedy:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest set of most likely tokens whose mass reaches top_p (the first one always stays).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
