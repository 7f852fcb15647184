"""Chat and text completions: resolve the model, build the prompts, run the engine, record the request.

`InferenceService.start_generation` turns a caller's `GenerationRequest` (its prompts, each a `ChatPrompt` or a
`TextPrompt`, and its conversion to sampling parameters) into a running `Generation`, or raises a `server.errors`
error before anything is generated (unknown model, prompt too long, rate limit, full queue). A `Generation` is read
once, as a stream of deltas or whole; either way every request that reached this service leaves one
`inference_records` row (key, requested model, answering version, tokens, latency, status), and a generation
abandoned early (its reader cancelled: the client left) stops the engine's work and is recorded as 499. Nothing here
knows HTTP: the routes turn `Generation`s into OpenAI's responses and chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import anyio
from sqlalchemy import insert

from finetune.datasets.rendering import renders_tools, uses_tools
from server.db.base import utcnow
from server.db.models import InferenceRecord
from server.db.row_writer import RowWriter
from server.db.session import RequestReads
from server.engines import create_engine
from server.engines.base import (
    ChoiceDelta,
    Engine,
    EngineError,
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    ModelLoadError,
    SamplingParams,
    TokenLogprob,
)
from server.engines.grammar import GrammarError, OutputGrammar
from server.engines.heap import freeze_startup_heap
from server.errors import APIError, GenerationFailed, InvalidRequest, ServiceUnavailable, TooManyRequests
from server.services.access import Principal, Scope
from server.services.chat_encoding import encode_chat
from server.services.model_resolution import ServableModel, resolve
from server.services.prompt_length import min_tokens
from server.services.quotas import OpenStreams
from server.services.tool_calls import ToolCall, ToolCallParser, parse_delta
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


class PromptTooLong(InvalidRequest):
    """A prompt that leaves no room for a completion in the model's context (400 `context_length_exceeded`)."""

    def __init__(self, message: str, *, param: str, tokens: int) -> None:
        super().__init__(message, param=param, code="context_length_exceeded")
        self.tokens = tokens  # the prompt's tokens, or a lower bound of them when it was refused by its length


class TokenBudget(Protocol):
    """Per-key token limits (`server.api.ratelimit.RateLimits`)."""

    def charge_tokens(self, key_id: str, tokens: int, *, param: str) -> None:
        """Count a request's tokens (prompt plus max completion) against the key's limit, or raise `RateLimited`."""

    def charge_refused(self, key_id: str, tokens: int) -> None:
        """Count the tokens of a request refused for its prompt's length (up to the whole limit), never raising."""


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages (`{"role", "content"}`, tool calls and results as transformers' templates take them) and the
    tools (OpenAI's function definitions), rendered with the model's chat template."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    endpoint: ClassVar[str] = "chat.completions"
    param: ClassVar[str] = "messages"

    def text(self, tokenizer: PreTrainedTokenizerBase) -> str:
        self._check(tokenizer)
        return _render_chat(tokenizer, self.messages, self.tools)

    def token_ids(self, tokenizer: PreTrainedTokenizerBase, context: int) -> list[int] | int:
        """The prompt's token ids; or, when its length alone shows it takes `context` tokens or more, a lower bound
        of its token count, found without tokenizing it."""
        text = self.text(tokenizer)
        if (at_least := min_tokens(tokenizer, text)) >= context:
            return at_least

        def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
            # The text rendered above, unless encode_chat masked special-token spellings in a copy.
            if messages is self.messages and tools is self.tools:
                return text
            return _render_chat(tokenizer, messages, tools)

        # The template writes the special tokens itself (BOS, turn markers); in what the caller wrote, their
        # spellings are text (`server.services.chat_encoding`).
        return encode_chat(tokenizer, self.messages, self.tools, render)

    def _check(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not tokenizer.chat_template:
            raise InvalidRequest("This model has no chat template; use /v1/completions.", param="model")
        if uses_tools(self.messages, self.tools) and not renders_tools(tokenizer):
            param = "tools" if self.tools else "messages"
            raise InvalidRequest(
                f"{param}: this model's chat template does not render tools, tool calls and tool results in the "
                "<tool_call> format; register a model whose tokenizer writes it.",
                param=param,
            )


def _render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> str:
    functions: list[dict[Any, Any] | Callable[..., Any]] = [*(tools or [])]
    text = tokenizer.apply_chat_template(messages, tools=functions or None, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) gave a {type(text).__name__}")
    return text


@dataclass(frozen=True)
class TextPrompt:
    """A raw prompt: text, or token ids."""

    prompt: str | list[int]
    endpoint: ClassVar[str] = "completions"
    param: ClassVar[str] = "prompt"

    def text(self, tokenizer: PreTrainedTokenizerBase) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        from zaya_model.pretrain.tokenizer import decode_text  # transformers: loaded with the tokenizer given

        return decode_text(tokenizer, self.prompt)

    def token_ids(self, tokenizer: PreTrainedTokenizerBase, context: int) -> list[int] | int:
        """As `ChatPrompt.token_ids`: the ids, or a count of `context` or more when the prompt cannot fit."""
        if isinstance(self.prompt, str):
            if (at_least := min_tokens(tokenizer, self.prompt)) >= context:
                return at_least
            token_ids: list[int] = tokenizer.encode(self.prompt, add_special_tokens=False)
            return token_ids
        if len(self.prompt) >= context:
            return len(self.prompt)
        if any(token < 0 or token >= len(tokenizer) for token in self.prompt):
            raise InvalidRequest(f"prompt: token ids must be in [0, {len(tokenizer)}).", param="prompt")
        return list(self.prompt)


Prompt = ChatPrompt | TextPrompt


class GenerationRequest(Protocol):
    """A request as this service runs it (`server.api.inference.protocol` defines the API's)."""

    model: str

    @property
    def max_tokens_param(self) -> str:
        """The request field that sets the completion's length, named in errors about it."""

    @property
    def echo_prompt(self) -> bool:
        """Each choice's text (and logprobs, if asked for) starts with its prompt's."""

    def prompts(self) -> list[Prompt]:
        """The prompts, each completed by `n` choices (indexed prompt by prompt)."""

    @property
    def grammar(self) -> OutputGrammar | None:
        """The grammar every choice is decoded under, if any; raises `GrammarError` for one that cannot be built."""

    @property
    def parses_tool_calls(self) -> bool:
        """The choices' tool calls are parsed out of their text."""

    def to_sampling_params(self, room: int) -> SamplingParams:
        """The sampling parameters of a prompt that leaves `room` tokens of the context for its completion."""


@dataclass
class FinishedChoice:
    """One choice of a whole answer."""

    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class _PreparedPrompt:
    """One prompt of a request, checked against the model's context: ready to start."""

    token_ids: list[int]
    params: SamplingParams
    echo: str | None  # the prompt's text, put before its choices' (echo)


@dataclass
class _Run:
    """One prompt's generation in the engine: its first delta (already read) and the rest of its stream."""

    first: ChoiceDelta
    deltas: AsyncGenerator[ChoiceDelta, None]
    echo: str | None  # the prompt's text, put before its choices' (echo)


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

    def row(self) -> dict[str, Any]:
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
    """A started generation of `n` choices per prompt, read once: `deltas()` (a stream) or `collect()` (the whole
    answer). Choice `i` of prompt `p` is choice `p * n + i` of the answer, as OpenAI indexes them.

    `aclose()` (or leaving it as an async context manager) stops the engine's work if it is not done and writes the
    request's record, once. Reading it to the end records 200; an engine failure on the way raises
    `GenerationFailed` (recorded 500); a reader that stops early (cancelled, or closing the stream) leaves 499.
    """

    def __init__(
        self,
        record: _Record,
        runs: list[_Run],
        n: int,
        rows: RowWriter,
        close_stream: Callable[[], None],
        *,
        parses_tool_calls: bool = False,
    ) -> None:
        """`close_stream` gives back the request's place among its key's open streams (`OpenStreams`);
        `parses_tool_calls`: each choice's tool calls are parsed out of its text (`ChoiceDelta.tool_calls`)."""
        self._record, self._runs, self._rows = record, runs, rows
        self._close_stream = close_stream
        self._tool_parsers: dict[int, ToolCallParser] | None = {} if parses_tool_calls else None
        self.choices_per_prompt = n
        self.n = n * len(runs)
        self._tokens = [0] * self.n
        self._cached_tokens = 0
        self._pumps: list[asyncio.Task[None]] = []  # reading the runs' streams, when there are several
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

    async def deltas(self) -> AsyncGenerator[ChoiceDelta, None]:
        """The choices' deltas, interleaved, as the engine releases them."""
        record, tokens = self._record, self._tokens
        record.status_code = CLIENT_CLOSED_REQUEST  # until the last delta is read
        started: set[int] = set()
        try:
            async for prompt, delta in self._interleaved():
                delta.index += prompt * self.choices_per_prompt
                if delta.index not in started:
                    started.add(delta.index)
                    _echo(delta, self._runs[prompt].echo)
                if self._tool_parsers is not None:
                    parse_delta(delta, self._tool_parsers.setdefault(delta.index, ToolCallParser()))
                tokens[delta.index] = delta.completion_tokens
                record.completion_tokens = sum(tokens)
                self._cached_tokens = max(self._cached_tokens, delta.cached_prompt_tokens)
                yield delta
        except EngineError as error:
            record.status_code = 500
            raise GenerationFailed(error.message, code="engine_failure") from error
        record.status_code = 200

    async def _interleaved(self) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        """(prompt, delta) of every run, as they come."""
        if len(self._runs) == 1:
            run = self._runs[0]
            yield 0, run.first
            async for delta in run.deltas:
                yield 0, delta
            return
        queue: asyncio.Queue[tuple[int, ChoiceDelta | BaseException | None]] = asyncio.Queue()

        async def pump(prompt: int, run: _Run) -> None:
            try:
                queue.put_nowait((prompt, run.first))
                async for delta in run.deltas:
                    queue.put_nowait((prompt, delta))
                queue.put_nowait((prompt, None))
            except Exception as error:  # an engine failure: the reader raises it
                queue.put_nowait((prompt, error))

        self._pumps = [asyncio.create_task(pump(prompt, run)) for prompt, run in enumerate(self._runs)]
        running = len(self._runs)
        while running:
            prompt, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield prompt, item

    async def collect(self) -> list[FinishedChoice]:
        """Every choice, once all are finished."""
        texts: list[list[str]] = [[] for _ in range(self.n)]
        choices = [FinishedChoice(index, "", [], None) for index in range(self.n)]
        async for delta in self.deltas():
            choice = choices[delta.index]
            texts[delta.index].append(delta.text)
            choice.logprobs.extend(delta.logprobs)
            choice.finish_reason = delta.finish_reason or choice.finish_reason
            for call in delta.tool_calls:
                if call.id is not None:  # a call's first piece
                    choice.tool_calls.append(ToolCall(call.id, call.name or "", ""))
                choice.tool_calls[call.index].arguments += call.arguments
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
            await _close_runs(self._runs, self._pumps)
            self._close_stream()
            await self._rows.execute(INSERT_RECORD, self._record.row())


def _echo(delta: ChoiceDelta, prompt_text: str | None) -> None:
    """Start a choice's first delta with its prompt: the text (echo) and the prompt's logprobs, when scored."""
    if prompt_text is not None:
        delta.text = prompt_text + delta.text
    if delta.prompt_logprobs is not None:
        delta.logprobs = delta.prompt_logprobs + delta.logprobs


async def _close_runs(runs: list[_Run], pumps: list[asyncio.Task[None]]) -> None:
    """Stop the runs' engine work: the tasks reading their streams first, then the streams themselves."""
    for pump in pumps:
        pump.cancel()
    await asyncio.gather(*pumps, return_exceptions=True)
    for run in runs:
        await run.deltas.aclose()


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
        self._starting: asyncio.Task[None] | None = None

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

    def health(self) -> dict[str, Any]:
        """`{"status": "ready" | "not_started" | "loading" | "failed" | <the engine's own status>, "kind", ...}`.

        `not_started` is ready too: the engine is created on first use.
        """
        report: dict[str, Any] = {"status": self._engine_state, "kind": self.settings.engine}
        if self._engine_error is not None:
            report["error"] = self._engine_error
        if self._engine is not None:
            details = self._engine.health()
            report.update({key: value for key, value in details.items() if key not in ("status", "engine")})
            if details.get("status") != "ok":
                report["status"] = details.get("status", "unavailable")
        return report

    async def tokenizer(self, scope: Scope, model: str) -> PreTrainedTokenizerBase:
        """The tokenizer `model` is served with (resolved as a request's `model` is, within `scope`); 404 or 503 as a
        request gets."""
        servable = await self.reads.run(resolve, scope, model)
        try:
            return await self.engine.tokenizer(servable.base)
        except ModelLoadError as error:
            raise ServiceUnavailable(error.message, code="model_unavailable") from error

    # --- the request flow -------------------------------------------------------------------------------------
    async def start_generation(self, caller: Principal, request: GenerationRequest) -> Generation:
        """Resolve the model as the caller's project sees it, check and charge the request, and start generating;
        refusals are recorded and raised."""
        prompts = request.prompts()
        key_id = caller.key_id
        record = _Record(key_id, caller.project_id, prompts[0].endpoint, request.model)
        try:
            close_stream = self.open_streams.open(key_id)
            try:
                await _build_grammar(request)
                servable = await self.reads.run(resolve, caller.scope, request.model)
                record.model_version_id = servable.version_id
                prepared = [await self._prepare(servable, prompt, request) for prompt in prompts]
                record.prompt_tokens = sum(len(each.token_ids) for each in prepared)
                tokens = sum(len(each.token_ids) + each.params.max_tokens * each.params.n for each in prepared)
                self.budget.charge_tokens(key_id, tokens, param=request.max_tokens_param)
                runs = await self._start_runs(servable, prepared)
            except BaseException:
                close_stream()
                raise
        except PromptTooLong as error:
            # Refused, yet counted: the prompt's tokens are charged to the key as if it had run, so sending prompts
            # that cannot fit costs a key its token budget as running them would.
            self.budget.charge_refused(key_id, error.tokens)
            record.status_code = error.status_code
            await self.rows.execute(INSERT_RECORD, record.row())
            raise
        except APIError as error:
            record.status_code = error.status_code
            await self.rows.execute(INSERT_RECORD, record.row())
            raise
        return Generation(
            record, runs, prepared[0].params.n, self.rows, close_stream, parses_tool_calls=request.parses_tool_calls
        )

    async def _prepare(self, servable: ServableModel, prompt: Prompt, request: GenerationRequest) -> _PreparedPrompt:
        try:
            tokenizer = await self.engine.tokenizer(servable.base)
            context = await self.engine.context_length(servable.base)
        except ModelLoadError as error:
            raise ServiceUnavailable(error.message, code="model_unavailable") from error
        # Rendering and tokenizing a long prompt takes seconds: off the event loop, which keeps serving meanwhile.
        prompt_ids = await anyio.to_thread.run_sync(prompt.token_ids, tokenizer, context)
        if isinstance(prompt_ids, int):  # refused by its length alone, before tokenizing
            raise PromptTooLong(
                f"This model's maximum context length is {context} tokens; your {prompt.param} use at least "
                f"{prompt_ids} tokens, leaving no room for a completion.",
                param=prompt.param,
                tokens=prompt_ids,
            )
        if not prompt_ids:
            raise InvalidRequest(f"{prompt.param}: the prompt is empty.", param=prompt.param)
        if len(prompt_ids) >= context:
            raise PromptTooLong(
                f"This model's maximum context length is {context} tokens; your {prompt.param} use "
                f"{len(prompt_ids)} tokens, leaving no room for a completion.",
                param=prompt.param,
                tokens=len(prompt_ids),
            )
        params = request.to_sampling_params(context - len(prompt_ids))
        if len(prompt_ids) + params.max_tokens > context:
            raise InvalidRequest(
                f"This model's maximum context length is {context} tokens; you requested "
                f"{len(prompt_ids) + params.max_tokens} ({len(prompt_ids)} in the {prompt.param}, "
                f"{params.max_tokens} for the completion). Lower {request.max_tokens_param} or shorten the "
                f"{prompt.param}.",
                param=request.max_tokens_param,
                code="context_length_exceeded",
            )
        echo = await anyio.to_thread.run_sync(prompt.text, tokenizer) if request.echo_prompt else None
        return _PreparedPrompt(prompt_ids, params, echo)

    async def _start_runs(self, servable: ServableModel, prepared: list[_PreparedPrompt]) -> list[_Run]:
        """Start every prompt's generation at once (so the engine batches them) and wait for their first deltas."""
        streams = [
            self.engine.generate(servable.base, each.token_ids, each.params, adapter=servable.adapter)
            for each in prepared
        ]
        firsts = await asyncio.gather(*(_first_delta(stream) for stream in streams), return_exceptions=True)
        failures = [first for first in firsts if isinstance(first, BaseException)]
        if failures:
            for stream in streams:
                await stream.aclose()
            raise failures[0]
        return [
            _Run(first, stream, each.echo)
            for first, stream, each in zip(firsts, streams, prepared, strict=True)
            if not isinstance(first, BaseException)  # none is: any failure was raised above
        ]


async def _build_grammar(request: GenerationRequest) -> None:
    """Build (and keep) the request's grammar off the event loop: checking a large schema takes a while."""
    try:
        await asyncio.to_thread(lambda: request.grammar)
    except GrammarError as error:
        raise InvalidRequest(error.message, param=error.param) from error


async def _first_delta(deltas: AsyncIterator[ChoiceDelta]) -> ChoiceDelta:
    """Start generating and wait for the first output, so refusals still become proper errors."""
    try:
        return await anext(deltas)
    except EngineError as error:
        raise engine_error(error) from error


def engine_error(error: EngineError) -> APIError:
    """The API error for an engine's: 400 for a request it refuses, 429 for a full queue, 503 (with Retry-After
    where known) for a model or engine that cannot take requests now, 500 for a failure while generating."""
    if isinstance(error, EngineOverloaded):
        # The queue drains in about a decode batch's time: a second is a fair hint for clients to back off.
        headers = {"Retry-After": str(OVERLOADED_RETRY_AFTER_S)}
        return TooManyRequests(error.message, code="engine_overloaded", headers=headers)
    if isinstance(error, ModelLoadError):
        return ServiceUnavailable(error.message, code="model_unavailable")
    if isinstance(error, EngineUnavailable):
        headers = {"Retry-After": str(error.retry_after_s)}
        return ServiceUnavailable(error.message, code="engine_unavailable", headers=headers)
    if isinstance(error, EngineFailure):
        return GenerationFailed(error.message, code="engine_failure")
    return InvalidRequest(error.message, param=error.param)
