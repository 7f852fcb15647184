"""Choosing the next token of one sequence, as vLLM's sampler does, with the choice's own RNG.

The logits are adjusted first (end-of-sequence tokens masked until `min_tokens`, `logit_bias`, then the repetition,
frequency and presence penalties); then the token is the most likely one (greedy) or drawn after temperature, top-k
and nucleus (top-p) filtering. `SamplingParams` defines each step.
"""

from __future__ import annotations

import secrets

import torch

from server.engines.base import SamplingParams


def choice_generator(seed: int | None, choice_index: int) -> torch.Generator:
    """An RNG per choice: the same seed gives the same choices whatever else shares the batch."""
    return torch.Generator().manual_seed(choice_seed(seed, choice_index))


def choice_seed(seed: int | None, choice_index: int) -> int:
    """Distinct, reproducible seeds for the n choices of one seeded request (random without a seed)."""
    if seed is None:
        return secrets.randbits(63)
    return (seed * 1_000_003 + choice_index) % 2**63


class TokenSampler:
    """The next-token choice of one sequence: keeps what its adjustments need (output token counts, the prompt's
    tokens), built only for the adjustments its parameters ask for."""

    def __init__(
        self, params: SamplingParams, prompt_token_ids: list[int], end_ids: frozenset[int], generator: torch.Generator
    ) -> None:
        self.params, self.generator = params, generator
        self.generated = 0
        self._prompt = prompt_token_ids
        self._end_ids = torch.tensor(sorted(end_ids)) if params.min_tokens and not params.ignore_eos else None
        self._bias = (
            (torch.tensor(list(params.logit_bias)), torch.tensor(list(params.logit_bias.values())))
            if params.logit_bias
            else None
        )
        self._penalised = (
            params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        )
        self._counts: torch.Tensor | None = None  # [vocab]: times each token was generated
        self._in_prompt: torch.Tensor | None = None  # [vocab]: whether each token is in the prompt

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token, from the sequence's next-token `logits` [vocab]."""
        logits = self._adjusted(logits.float())
        token = int(logits.argmax()) if self.params.greedy else self._draw(logits)
        self.generated += 1
        if self._counts is not None:
            self._counts[token] += 1
        return token

    def _adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        params = self.params
        if self._end_ids is not None and self.generated < params.min_tokens:
            logits = logits.index_fill(0, self._end_ids, float("-inf"))
        if self._bias is not None:
            logits = logits.index_add(0, *self._bias)
        if self._penalised:
            logits = self._penalise(logits)
        return logits

    def _penalise(self, logits: torch.Tensor) -> torch.Tensor:
        params = self.params
        if self._counts is None or self._in_prompt is None:
            self._counts = torch.zeros(logits.shape[0])
            self._in_prompt = torch.zeros(logits.shape[0], dtype=torch.bool)
            self._in_prompt[torch.tensor(self._prompt)] = True
        generated = self._counts > 0
        if params.repetition_penalty != 1.0:
            seen = generated | self._in_prompt
            penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
            logits = torch.where(seen, penalised, logits)
        return logits - params.frequency_penalty * self._counts - params.presence_penalty * generated

    def _draw(self, logits: torch.Tensor) -> int:
        params = self.params
        logits = logits / params.temperature
        if 0 < params.top_k < logits.shape[0]:
            # Ties with the k-th largest logit stay in, as in vLLM.
            kth = logits.topk(params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest set of most likely tokens whose mass reaches top_p (the first one always stays).
            outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
