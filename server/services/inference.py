"""Chat and text completions: resolve the model, build the prompt, run the engine, record the request.

`InferenceService.start` turns a caller's request (a `ChatPrompt` or a `TextPrompt`, and `GenerationOptions`) into a
running `Generation`, or raises a `server.errors` error before anything is generated (unknown model, prompt too
long, rate limit, full queue). A `Generation` is read once, as a stream of deltas or whole; either way every request
that reached this service leaves one `inference_records` row (key, requested model, answering version, tokens,
latency, status), and a generation abandoned early (its reader cancelled: the client left) stops the engine's work
and is recorded as 499. Nothing here knows HTTP: the routes turn `Generation`s into OpenAI's responses and chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import anyio
from sqlalchemy import insert

from server.db.base import utcnow
from server.db.models import InferenceRecord
from server.db.row_writer import RowWriter
from server.db.session import RequestReads
from server.engines import create_engine
from server.engines.base import (
    ChoiceDelta,
    Engine,
    EngineError,
    EngineOverloaded,
    ModelLoadError,
    SamplingParams,
    TokenLogprob,
)
from server.errors import APIError, GenerationFailed, InvalidRequest, ServiceUnavailable, TooManyRequests
from server.heap import freeze_startup_heap
from server.services.access import Principal
from server.services.model_resolution import ServableModel, resolve
from server.services.quotas import OpenStreams
from server.settings import Settings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
ENGINE_LOADING_RETRY_AFTER_S = 5
OVERLOADED_RETRY_AFTER_S = 1
INSERT_RECORD = insert(InferenceRecord)

EngineState = Literal["not_started", "loading", "ready", "failed"]
READY_ENGINE_STATES = frozenset({"not_started", "ready"})

logger = logging.getLogger(__name__)


class TokenBudget(Protocol):
    """Per-key token limits (`server.api.ratelimit.RateLimits`)."""

    def charge_tokens(self, key_id: str, tokens: int, *, param: str) -> None:
        """Count a request's tokens (prompt plus max completion) against the key's limit, or raise `RateLimited`."""


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages (`{"role", "content"}`), rendered with the model's chat template."""

    messages: list[dict[str, str]]
    endpoint: ClassVar[str] = "chat.completions"
    param: ClassVar[str] = "messages"

    def token_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        if not tokenizer.chat_template:
            raise InvalidRequest("This model has no chat template; use /v1/completions.", param="model")
        text = tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        # The template writes the special tokens itself (BOS, turn markers).
        return tokenizer.encode(text, add_special_tokens=False)


@dataclass(frozen=True)
class TextPrompt:
    """A raw prompt: text, or token ids."""

    prompt: str | list[int]
    endpoint: ClassVar[str] = "completions"
    param: ClassVar[str] = "prompt"

    def token_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        if isinstance(self.prompt, str):
            return tokenizer.encode(self.prompt, add_special_tokens=False)
        if any(token < 0 or token >= len(tokenizer) for token in self.prompt):
            raise InvalidRequest(f"prompt: token ids must be in [0, {len(tokenizer)}).", param="prompt")
        return list(self.prompt)


Prompt = ChatPrompt | TextPrompt


@dataclass(frozen=True)
class GenerationOptions:
    """The sampling fields of a request, validated by the route's schema (ranges) and here (context length).

    `max_tokens_param` names the request field that set `max_tokens`, for errors about it.
    """

    max_tokens: int | None
    max_tokens_param: str
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False


@dataclass
class FinishedChoice:
    """One choice of a whole answer."""

    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None


@dataclass
class _Record:
    api_key_id: str
    project_id: str
    endpoint: str
    requested_model: str
    model_version_id: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status_code: int = 200
    started: float = field(default_factory=time.perf_counter)

    def row(self) -> dict:
        """The `inference_records` row, timed now."""
        return {
            "created_at": utcnow(),
            "api_key_id": self.api_key_id,
            "project_id": self.project_id,
            "endpoint": self.endpoint,
            "requested_model": self.requested_model[:256],
            "model_version_id": self.model_version_id,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "latency_ms": (time.perf_counter() - self.started) * 1000,
            "status_code": self.status_code,
        }


class Generation:
    """A started generation of `n` choices, read once: `deltas()` (a stream) or `collect()` (the whole answer).

    `aclose()` (or leaving it as an async context manager) stops the engine's work if it is not done and writes the
    request's record, once. Reading it to the end records 200; an engine failure on the way raises
    `GenerationFailed` (recorded 500); a reader that stops early (cancelled, or closing the stream) leaves 499.
    """

    def __init__(
        self,
        record: _Record,
        first: ChoiceDelta,
        deltas: AsyncIterator[ChoiceDelta],
        n: int,
        rows: RowWriter,
        close_stream: Callable[[], None],
    ) -> None:
        self._record, self._first, self._deltas, self._rows = record, first, deltas, rows
        self._close_stream = close_stream
        self.n = n
        self._tokens = [0] * n
        self._cached_tokens = 0
        self._closed = False

    @property
    def prompt_tokens(self) -> int:
        return self._record.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self._record.completion_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the engine's prefix cache (OpenAI's `prompt_tokens_details.cached_tokens`)."""
        return self._cached_tokens

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """The choices' deltas, interleaved, as the engine releases them."""
        record, tokens = self._record, self._tokens
        record.status_code = CLIENT_CLOSED_REQUEST  # until the last delta is read
        try:
            delta: ChoiceDelta | None = self._first
            while delta is not None:
                tokens[delta.index] = delta.completion_tokens
                record.completion_tokens = sum(tokens)
                self._cached_tokens = max(self._cached_tokens, delta.cached_prompt_tokens)
                yield delta
                delta = await anext(self._deltas, None)
        except EngineError as error:
            record.status_code = 500
            raise GenerationFailed(error.message) from error
        record.status_code = 200

    async def collect(self) -> list[FinishedChoice]:
        """Every choice, once all are finished."""
        texts: list[list[str]] = [[] for _ in range(self.n)]
        choices = [FinishedChoice(index, "", [], None) for index in range(self.n)]
        async for delta in self.deltas():
            choice = choices[delta.index]
            texts[delta.index].append(delta.text)
            choice.logprobs.extend(delta.logprobs)
            choice.finish_reason = delta.finish_reason or choice.finish_reason
        for choice, text in zip(choices, texts, strict=True):
            choice.text = "".join(text)
        return choices

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._deltas.aclose()
            self._close_stream()
            await self._rows.execute(INSERT_RECORD, self._record.row())


def _import_model_libraries() -> None:
    """Import transformers' lazily loaded pieces once, in one thread: its lazy module is not safe to import from two
    threads at once (seen as `cannot import name 'AutoTokenizer' from 'transformers'` on a request made while the
    engine loaded)."""
    import transformers

    import zaya_model.modeling_zaya  # noqa: F401

    for name in ("AutoConfig", "AutoTokenizer", "PreTrainedTokenizerFast", "PreTrainedModel", "Trainer"):
        getattr(transformers, name)


class InferenceService:
    """One per app: owns the engine.

    The app's startup calls `start`, which creates the engine in a thread (vLLM takes minutes) while `/health` reports
    it `loading`; a failure there is kept (`failed`, with its message) until restart. Without `start` (a service used
    on its own) the engine is created on first use.
    """

    def __init__(
        self,
        settings: Settings,
        reads: RequestReads,
        rows: RowWriter,
        budget: TokenBudget,
        *,
        engine: Engine | None = None,
        engine_factory: Callable[[Settings], Engine] = create_engine,
    ) -> None:
        """`reads` resolve models, `rows` writes the inference records, `budget` charges each request's tokens."""
        self.settings, self.reads, self.rows, self.budget = settings, reads, rows, budget
        self.open_streams = OpenStreams(settings.key_max_open_streams)
        self._engine = engine
        self._engine_factory = engine_factory
        self._engine_state: EngineState = "ready" if engine is not None else "not_started"
        self._engine_error: str | None = None
        self._starting: asyncio.Task | None = None

    async def start(self) -> None:
        if self._engine_state == "not_started":
            # Before the engine's thread and request threads (fine-tuning jobs, tokenizers) import them side by side.
            await asyncio.to_thread(_import_model_libraries)
            self._engine_state = "loading"
            self._starting = asyncio.create_task(self._create_engine())

    async def _create_engine(self) -> None:
        try:
            engine = await asyncio.to_thread(self._engine_factory, self.settings)
        except Exception as error:
            logger.exception("the %s inference engine failed to start", self.settings.engine)
            # Shown by the unauthenticated /health: the first line only, the details are in the log.
            reason = error.message if isinstance(error, EngineError) else f"{type(error).__name__}: {error}"
            self._engine_error = reason.splitlines()[0][:200]
            self._engine_state = "failed"
            return
        freeze_startup_heap()
        self._engine, self._engine_state = engine, "ready"

    @property
    def engine(self) -> Engine:
        if self._engine is not None:
            return self._engine
        if self._engine_state == "loading":
            raise ServiceUnavailable(
                "The inference engine is still starting; retry shortly.",
                code="engine_loading",
                headers={"Retry-After": str(ENGINE_LOADING_RETRY_AFTER_S)},
            )
        if self._engine_state == "failed":
            raise ServiceUnavailable(
                f"The inference engine failed to start: {self._engine_error}", code="engine_unavailable"
            )
        try:
            self._engine = self._engine_factory(self.settings)
        except EngineError as error:
            raise ServiceUnavailable(error.message, code="engine_unavailable") from error
        self._engine_state = "ready"
        return self._engine

    async def close(self) -> None:
        if self._starting is not None:
            await asyncio.gather(self._starting, return_exceptions=True)
        if self._engine is not None:
            await self._engine.close()

    def health(self) -> dict:
        """`{"status": "ready" | "not_started" | "loading" | "failed" | <the engine's own status>, "kind", ...}`.

        `not_started` is ready too: the engine is created on first use.
        """
        report = {"status": self._engine_state, "kind": self.settings.engine}
        if self._engine_error is not None:
            report["error"] = self._engine_error
        if self._engine is not None:
            details = self._engine.health()
            report.update({key: value for key, value in details.items() if key not in ("status", "engine")})
            if details.get("status") != "ok":
                report["status"] = details.get("status", "unavailable")
        return report

    # --- the request flow -------------------------------------------------------------------------------------
    async def start_generation(
        self, caller: Principal, model: str, prompt: Prompt, options: GenerationOptions
    ) -> Generation:
        """Resolve `model` as the caller's project sees it, check and charge the request, and start generating;
        refusals are recorded and raised."""
        key_id = caller.key_id
        record = _Record(key_id, caller.project_id, prompt.endpoint, model)
        try:
            close_stream = self.open_streams.open(key_id)
            try:
                servable = await self.reads.run(resolve, caller.scope, model)
                record.model_version_id = servable.version_id
                prompt_ids, params = await self._prepare(servable, prompt, options)
                record.prompt_tokens = len(prompt_ids)
                self.budget.charge_tokens(
                    key_id, len(prompt_ids) + params.max_tokens * params.n, param=options.max_tokens_param
                )
                deltas = self.engine.generate(servable.base, prompt_ids, params, adapter=servable.adapter)
                first = await _first_delta(deltas)
            except BaseException:
                close_stream()
                raise
        except APIError as error:
            record.status_code = error.status_code
            await self.rows.execute(INSERT_RECORD, record.row())
            raise
        return Generation(record, first, deltas, options.n, self.rows, close_stream)

    async def _prepare(
        self, servable: ServableModel, prompt: Prompt, options: GenerationOptions
    ) -> tuple[list[int], SamplingParams]:
        try:
            tokenizer = await self.engine.tokenizer(servable.base)
            context = await self.engine.context_length(servable.base)
        except ModelLoadError as error:
            raise ServiceUnavailable(error.message, code="model_unavailable") from error
        prompt_ids = prompt.token_ids(tokenizer)
        if not prompt_ids:
            raise InvalidRequest(f"{prompt.param}: the prompt is empty.", param=prompt.param)
        if len(prompt_ids) >= context:
            raise InvalidRequest(
                f"This model's maximum context length is {context} tokens; your {prompt.param} use "
                f"{len(prompt_ids)} tokens, leaving no room for a completion.",
                param=prompt.param,
                code="context_length_exceeded",
            )
        max_tokens = options.max_tokens if options.max_tokens is not None else context - len(prompt_ids)
        if len(prompt_ids) + max_tokens > context:
            raise InvalidRequest(
                f"This model's maximum context length is {context} tokens; you requested "
                f"{len(prompt_ids) + max_tokens} ({len(prompt_ids)} in the {prompt.param}, {max_tokens} for the "
                f"completion). Lower {options.max_tokens_param} or shorten the {prompt.param}.",
                param=options.max_tokens_param,
                code="context_length_exceeded",
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            n=options.n,
            temperature=options.temperature,
            top_p=options.top_p,
            seed=options.seed,
            stop=options.stop,
            logprobs=options.logprobs,
            top_logprobs=options.top_logprobs,
            ignore_eos=options.ignore_eos,
        )
        return prompt_ids, params


async def _first_delta(deltas: AsyncIterator[ChoiceDelta]) -> ChoiceDelta:
    """Start generating and wait for the first output, so refusals still become proper errors."""
    try:
        return await anext(deltas)
    except EngineOverloaded as error:
        # The queue drains in about a decode batch's time: a second is a fair hint for clients to back off.
        headers = {"Retry-After": str(OVERLOADED_RETRY_AFTER_S)}
        raise TooManyRequests(error.message, code="engine_overloaded", headers=headers) from error
    except ModelLoadError as error:
        raise ServiceUnavailable(error.message, code="model_unavailable") from error
    except EngineError as error:
        raise InvalidRequest(error.message, param=error.param) from error
