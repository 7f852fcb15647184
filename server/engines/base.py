"""The engine interface the server talks to: load model versions and adapters, stream tokens, report health.

An engine receives token ids (the service renders chat templates and counts tokens) and yields `ChoiceDelta`s: text
already detokenised and cut at stop strings, so every engine (`local` here, `vllm` later) gives the API the same
stream. Engines raise the `EngineError` subclasses below; the inference service maps them to HTTP errors.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from server.engines.grammar import OutputGrammar

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ModelRef:
    """A model version on disk: a full checkpoint (`from_pretrained`) or a PEFT adapter directory."""

    version_id: str
    path: Path


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Return each sampled token's log-probability, with this many alternatives (0: just the sampled token).
    logprobs: bool = False
    top_logprobs: int = 0
    # Generate past the model's end-of-sequence tokens, to exactly max_tokens unless a stop string ends the choice
    # first (vLLM's `ignore_eos`).
    ignore_eos: bool = False
    # Hold the text to this grammar (JSON of a schema, tool calls) by masking each step's logits: the choice ends at
    # an end-of-sequence token only once the grammar is complete. Logprobs are those of the masked distribution.
    grammar: OutputGrammar | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_p == 0.0


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    # The most likely alternatives at this position, best first: (token, logprob).
    top: tuple[tuple[str, float], ...] = ()


@dataclass
class ChoiceDelta:
    """New output of one choice: text released since the last delta (never a partial stop string)."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # `stop` (end of turn or a stop string) or `length` (max_tokens reached) on the choice's last delta.
    finish_reason: str | None = None
    # Tokens generated so far by this choice, end-of-sequence tokens included.
    completion_tokens: int = 0
    # Prompt tokens the engine took from its prefix cache instead of computing them (0 where it keeps none).
    cached_prompt_tokens: int = 0


class EngineError(Exception):
    """Something an engine refuses; `param` names the request field at fault, when there is one."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EngineOverloaded(EngineError):
    """The request queue is full: the client should retry later (HTTP 429)."""


class ModelLoadError(EngineError):
    """A model version or adapter could not be loaded (missing files, wrong base, unsupported weights)."""


class Engine(abc.ABC):
    """What the server needs from an inference engine. Implementations must be safe to call from one event loop."""

    name: str

    @abc.abstractmethod
    async def load_model(self, model: ModelRef) -> None:
        """Make a full model version servable (idempotent)."""

    @abc.abstractmethod
    async def unload_model(self, version_id: str) -> None:
        """Free a model version and every adapter loaded on it; running requests on it finish first or fail."""

    @abc.abstractmethod
    async def load_adapter(self, adapter: ModelRef, base: ModelRef) -> None:
        """Make an adapter version servable on top of `base` (idempotent); refuses adapters for another base."""

    @abc.abstractmethod
    async def unload_adapter(self, version_id: str) -> None:
        """Free an adapter version."""

    @abc.abstractmethod
    async def tokenizer(self, model: ModelRef) -> PreTrainedTokenizerBase:
        """The tokenizer (and chat template) of a full model version, loading it if needed."""

    @abc.abstractmethod
    async def context_length(self, model: ModelRef) -> int:
        """Most tokens (prompt plus completion) one sequence may hold."""

    @abc.abstractmethod
    def generate(
        self,
        model: ModelRef,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        adapter: ModelRef | None = None,
    ) -> AsyncIterator[ChoiceDelta]:
        """Stream the `params.n` choices' deltas, interleaved. Closing the iterator cancels the generation.

        A choice ends at max_tokens, a stop string, or one of the model's end-of-sequence tokens (end of turn and end
        of text), which are counted but never shown.

        Raises `EngineOverloaded` before the first delta when the queue is full.
        """

    @abc.abstractmethod
    def health(self) -> dict:
        """Readiness for `/health`: at least `{"status": "ok" | "unavailable", ...}`."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop background work and free every model."""
