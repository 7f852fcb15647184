"""The engine interface the server talks to, and what every engine shares.

An engine receives token ids (the service renders chat templates and counts tokens) and yields `ChoiceDelta`s: text
already detokenised and cut at stop strings, so every engine (`local`, `vllm`) gives the API the same stream. The
base class `Engine` holds what the engines share: the tokenizer and context-length caches, the checks of a request's
arguments against the model, and the loop that streams a request's deltas from the queue its choices write to
(`server.engines.output.ChoiceOutput` turns each choice's tokens into deltas). Engines raise the `EngineError`
subclasses below; the inference service maps them to HTTP errors.
"""

from __future__ import annotations

import abc
import asyncio
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from server.engines.grammar import OutputGrammar

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from zaya_model import ZayaConfig

T = TypeVar("T")


@dataclass(frozen=True)
class ModelRef:
    """A model version on disk: a full checkpoint (`from_pretrained`) or a PEFT adapter directory."""

    version_id: str
    path: Path


@dataclass(frozen=True)
class SamplingParams:
    """How one prompt's choices are generated: OpenAI's sampling fields and vLLM's extensions, with their meanings.

    Logits are adjusted in vLLM's order before a token is chosen: end-of-sequence tokens masked until `min_tokens`,
    `logit_bias` added, then `repetition_penalty`, `frequency_penalty` and `presence_penalty` applied; then the token
    is the most likely one (`greedy`) or drawn after `temperature`, `top_k` and `top_p`. Log-probabilities
    (`logprobs`, `prompt_logprobs`) are the model's own, before any adjustment; with a `grammar`, the grammar's mask
    comes first (as in vLLM) and they are those of the masked distribution.
    """

    max_tokens: int  # 0 only with `prompt_logprobs`: the prompt is scored, nothing generated
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Return each sampled token's log-probability, with this many alternatives (0: just the sampled token).
    logprobs: bool = False
    top_logprobs: int = 0
    # Return each prompt token's log-probability (the first has none) with this many alternatives; None: not at all.
    prompt_logprobs: int | None = None
    # Generate past the model's end-of-sequence tokens, to exactly max_tokens unless a stop string ends the choice
    # first (vLLM's `ignore_eos`).
    ignore_eos: bool = False
    # Tokens generated before an end-of-sequence token or a stop string may end the choice (vLLM's `min_tokens`).
    min_tokens: int = 0
    # Token id -> added to its logit (OpenAI's `logit_bias`, in [-100, 100]).
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    # OpenAI's: minus `frequency_penalty` x (times the token was generated), minus `presence_penalty` if it was at all.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # vLLM's and transformers': the logit of a token in the prompt or the output is divided by it (if positive) or
    # multiplied by it (if negative).
    repetition_penalty: float = 1.0
    # Hold the text to this grammar (JSON of a schema, tool calls) by masking each step's logits: the choice ends at
    # an end-of-sequence token only once the grammar is complete.
    grammar: OutputGrammar | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_p == 0.0


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float | None  # None only for a prompt's first token, which nothing predicts
    # The most likely alternatives at this position, best first: (token, logprob).
    top: tuple[tuple[str, float], ...] = ()


@dataclass
class ToolCallDelta:
    """New output of one tool call of a choice: its id and name when it starts, then pieces of its arguments (JSON
    text). Parsed out of the text by the inference service (`server.services.tool_calls`), never by an engine."""

    index: int  # of the call among the choice's calls
    id: str | None = None
    name: str | None = None
    arguments: str = ""


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
    # On a choice's first delta when `prompt_logprobs` was asked for: one entry per prompt token.
    prompt_logprobs: list[TokenLogprob] | None = None
    # Tool calls parsed out of the text, which then holds the rest (the service's, when a request has tools).
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class EngineError(Exception):
    """A request the engine refuses (HTTP 400); `param` names the request field at fault, when there is one.

    The subclasses are the engine's own conditions, never the request's fault: a full queue, a model that does not
    load, a failure while generating.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EngineOverloaded(EngineError):
    """The request queue is full: the client should retry later (HTTP 429)."""


class ModelLoadError(EngineError):
    """A model version or adapter could not be loaded (missing files, wrong base, unsupported weights)."""


class EngineFailure(EngineError):
    """The engine failed at a request it had accepted (a crashed forward pass, a dead engine core): a server error
    (HTTP 500)."""


class EngineUnavailable(EngineFailure):
    """The engine cannot take requests for a while (a dead engine core being restarted, a model unloaded under the
    request): retry after `retry_after_s` seconds (HTTP 503)."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LoadedModels(OrderedDict[str, T]):
    """The models an engine keeps loaded, by version id, least recently used first."""

    def use(self, version_id: str) -> T:
        """The model of `version_id`, now the most recently used."""
        self.move_to_end(version_id)
        return self[version_id]

    async def make_room(
        self, capacity: int, busy: Callable[[T], bool], unload: Callable[[str], Awaitable[None]]
    ) -> None:
        """Unload least recently used idle models until fewer than `capacity` are loaded."""
        while len(self) >= capacity:
            idle = next((version_id for version_id, model in self.items() if not busy(model)), None)
            if idle is None:
                raise EngineOverloaded("Every loaded model is busy; retry shortly.")
            await unload(idle)


# Where an engine's choices write: their deltas, or the error that ends the request.
DeltaQueue = asyncio.Queue[ChoiceDelta | BaseException]


class Engine(abc.ABC):
    """What the server needs from an inference engine. Implementations must be safe to call from one event loop.

    A subclass loads and frees models and, in `_submit`, starts a checked request's choices writing to its queue.
    """

    name: str

    def __init__(self) -> None:
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {}
        self._context: dict[str, int] = {}

    @property
    @abc.abstractmethod
    def max_choices(self) -> int:
        """Most choices (`n`) one request may ask for."""

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
    def health(self) -> dict[str, Any]:
        """Readiness for `/health`: at least `{"status": "ok" | "unavailable", ...}`."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop background work and free every model."""

    @abc.abstractmethod
    async def _submit(
        self,
        model: ModelRef,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter: ModelRef | None,
        deltas: DeltaQueue,
    ) -> Callable[[], None]:
        """Start generating the checked request's choices, each writing its deltas (or a failure) to `deltas`;
        return what stops them. Raises `EngineOverloaded` when the queue is full."""

    # --- shared ---------------------------------------------------------------------------------------------
    async def tokenizer(self, model: ModelRef) -> PreTrainedTokenizerBase:
        """The tokenizer (and chat template) of a full model version, loading it if needed."""
        if model.version_id not in self._tokenizers:
            self._tokenizers[model.version_id] = await asyncio.to_thread(load_model_tokenizer, model)
        return self._tokenizers[model.version_id]

    async def context_length(self, model: ModelRef) -> int:
        """Most tokens (prompt plus completion) one sequence may hold."""
        if model.version_id not in self._context:
            config = await asyncio.to_thread(load_model_config, model)
            self._context[model.version_id] = self._context_limit(config)
        return self._context[model.version_id]

    def _context_limit(self, config: ZayaConfig) -> int:
        return config.max_position_embeddings

    def _forget(self, version_id: str) -> None:
        """Drop a model version's cached tokenizer and context length."""
        self._tokenizers.pop(version_id, None)
        self._context.pop(version_id, None)

    async def generate(
        self,
        model: ModelRef,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        adapter: ModelRef | None = None,
    ) -> AsyncGenerator[ChoiceDelta, None]:
        """Stream the `params.n` choices' deltas, interleaved. Closing the iterator cancels the generation.

        A choice ends at max_tokens, a stop string, or one of the model's end-of-sequence tokens (end of turn and end
        of text), which are counted but never shown.

        Raises `EngineError` naming the field for arguments the model cannot take, and `EngineOverloaded` before the
        first delta when the queue is full.
        """
        await self._check(model, prompt_token_ids, params)
        deltas: DeltaQueue = asyncio.Queue()
        stop = await self._submit(model, prompt_token_ids, params, adapter, deltas)
        try:
            remaining = params.n
            while remaining:
                delta = await deltas.get()
                if isinstance(delta, BaseException):
                    raise delta
                remaining -= delta.finish_reason is not None
                yield delta
        finally:
            # Done, or the consumer left (a client gone). No await here: when the consumer is cancelled, its cancel
            # scope would cancel that await and skip the rest.
            stop()

    async def _check(self, model: ModelRef, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if params.n > self.max_choices:
            raise EngineError(f"n must be at most {self.max_choices} on this engine.", param="n")
        if len(prompt_token_ids) + params.max_tokens > await self.context_length(model):
            raise EngineError("The prompt plus max_tokens exceed the model's context length.", param="max_tokens")
        if params.min_tokens > params.max_tokens:
            raise EngineError("min_tokens must not exceed max_tokens.", param="min_tokens")
        if params.grammar is not None and (params.ignore_eos or params.min_tokens):
            # A complete grammar leaves only the end-of-sequence tokens to choose from.
            field = "ignore_eos" if params.ignore_eos else "min_tokens"
            raise EngineError(f"{field} cannot be combined with {params.grammar.param}.", param=field)
        vocabulary = len(await self.tokenizer(model))
        outside = sorted(token for token in params.logit_bias if not 0 <= token < vocabulary)
        if outside:
            raise EngineError(
                f"logit_bias: token ids must be in [0, {vocabulary}); got {outside[0]}.", param="logit_bias"
            )


# --- what every engine reads from a model version's directory ----------------------------------------------------
END_OF_TURN_TOKEN = "<|im_end|>"


def end_of_sequence_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """End of turn (chat answers) and end of text (raw completions): a choice stops at either."""
    ids = {tokenizer.eos_token_id}
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        ids.add(end_of_turn)
    return frozenset(i for i in ids if i is not None)


def load_model_tokenizer(model: ModelRef) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model.path)
    except Exception as error:
        raise ModelLoadError(f"Model version {model.version_id} has no loadable tokenizer: {error}") from error


def load_model_config(model: ModelRef) -> ZayaConfig:
    from zaya_model import ZayaConfig

    try:
        return ZayaConfig.from_pretrained(model.path)
    except Exception as error:
        raise ModelLoadError(f"Model version {model.version_id} has no loadable config: {error}") from error


def write_merged_checkpoint(adapter_dir: Path, base_dir: Path) -> Path:
    """Merge an adapter that trains expert weights or token rows into its base, as the full checkpoint engines serve
    in its place (`merged_checkpoint(adapter_dir)`, written atomically); `AdapterError` when it does not fit the
    base."""
    from zaya_model.training.adapter_merge import write_merged_checkpoint as write
    from zaya_model.vllm_plugin.adapters import merged_checkpoint, read_adapter_config

    read_adapter_config(adapter_dir)
    return write(adapter_dir, base_dir, merged_checkpoint(adapter_dir))
