"""Chat and text completions: resolve the model, build the prompt, run the engine, answer in OpenAI's shapes.

Both endpoints share one flow (`InferenceService.complete`); `ChatFormat` and `CompletionFormat` differ only in how
a prompt is made and how choices, chunks and logprobs look. Every request that reached this service leaves one
`inference_records` row (key, requested model, answering version, tokens, latency, status), whatever its outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from sqlalchemy import insert
from starlette.types import Receive, Scope, Send

from server.api.deps import Principal
from server.db.base import utcnow
from server.db.models import InferenceRecord
from server.db.row_writer import RowWriter
from server.db.session import RequestReads
from server.engines import create_engine
from server.engines.base import ChoiceDelta, Engine, EngineError, EngineOverloaded, ModelLoadError, SamplingParams
from server.errors import APIError, GenerationFailed, InvalidRequest, ServiceUnavailable, TooManyRequests
from server.heap import freeze_startup_heap
from server.services.model_resolution import ServableModel, resolve
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


@dataclass(frozen=True)
class GenerationOptions:
    """The sampling fields of a request, validated by the route's schema (ranges) and here (context length)."""

    max_tokens: int | None
    max_tokens_param: str
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    tokens: int = 0


class ChatFormat:
    endpoint = "chat.completions"
    prompt_param = "messages"
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, messages: list[dict]) -> None:
        self.messages = messages

    def prompt_token_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        if not tokenizer.chat_template:
            raise InvalidRequest("This model has no chat template; use /v1/completions.", param="model")
        text = tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        # The template writes the special tokens itself (BOS, turn markers).
        return tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def logprobs(entries: list, options: GenerationOptions) -> dict | None:
        if not options.logprobs:
            return None
        content = [
            {
                "token": entry.token,
                "logprob": entry.logprob,
                "bytes": list(entry.token.encode()),
                "top_logprobs": [
                    {"token": token, "logprob": logprob, "bytes": list(token.encode())} for token, logprob in entry.top
                ],
            }
            for entry in entries
        ]
        return {"content": content, "refusal": None}

    def choice(self, index: int, choice: _Choice, options: GenerationOptions) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": "".join(choice.text), "refusal": None},
            "logprobs": self.logprobs(choice.logprobs, options),
            "finish_reason": choice.finish_reason,
        }

    def opening_chunks(self, options: GenerationOptions) -> list[dict]:
        # OpenAI opens each choice's stream with the role.
        return [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(options.n)
        ]

    def chunk_choice(self, delta: ChoiceDelta, options: GenerationOptions) -> dict:
        return {
            "index": delta.index,
            "delta": {"content": delta.text} if delta.text else {},
            "logprobs": self.logprobs(delta.logprobs, options),
            "finish_reason": delta.finish_reason,
        }


class CompletionFormat:
    endpoint = "completions"
    prompt_param = "prompt"
    id_prefix = "cmpl-"
    object_name = chunk_object_name = "text_completion"

    def __init__(self, prompt: str | list[int]) -> None:
        self.prompt = prompt

    def prompt_token_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        if isinstance(self.prompt, str):
            return tokenizer.encode(self.prompt, add_special_tokens=False)
        if any(token < 0 or token >= len(tokenizer) for token in self.prompt):
            raise InvalidRequest(f"prompt: token ids must be in [0, {len(tokenizer)}).", param="prompt")
        return list(self.prompt)

    @staticmethod
    def logprobs(entries: list, options: GenerationOptions, offset: int = 0) -> dict | None:
        if not options.logprobs:
            return None
        offsets, position = [], offset
        for entry in entries:
            offsets.append(position)
            position += len(entry.token)
        return {
            "tokens": [entry.token for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [dict(entry.top) for entry in entries],
            "text_offset": offsets,
        }

    def choice(self, index: int, choice: _Choice, options: GenerationOptions) -> dict:
        return {
            "index": index,
            "text": "".join(choice.text),
            "logprobs": self.logprobs(choice.logprobs, options),
            "finish_reason": choice.finish_reason,
        }

    def opening_chunks(self, options: GenerationOptions) -> list[dict]:
        return []

    def chunk_choice(self, delta: ChoiceDelta, options: GenerationOptions) -> dict:
        return {
            "index": delta.index,
            "text": delta.text,
            "logprobs": self.logprobs(delta.logprobs, options),
            "finish_reason": delta.finish_reason,
        }


Format = ChatFormat | CompletionFormat


class DisconnectAwareStreamingResponse(StreamingResponse):
    """Streams while listening for the client leaving; then closes the body iterator, which cancels generation.

    Starlette's own response stops listening under ASGI 2.4 and leaves the iterator for the garbage collector.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tasks:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client left mid-send
                        await self.stream_response(send)
                    tasks.cancel_scope.cancel()

                tasks.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


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
        engine: Engine | None = None,
        engine_factory: Callable[[Settings], Engine] = create_engine,
    ) -> None:
        """`reads` resolve models, `rows` writes the inference records."""
        self.settings, self.reads, self.rows = settings, reads, rows
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
    async def complete(
        self, request: Request, principal: Principal, model: str, fmt: Format, options: GenerationOptions
    ) -> JSONResponse | StreamingResponse:
        record = _Record(principal.key_id, fmt.endpoint, model)
        try:
            servable = await self.reads.run(resolve, model)
            record.model_version_id = servable.version_id
            prompt, params = await self._prepare(servable, fmt, options)
            record.prompt_tokens = len(prompt)
            request.app.state.rate_limits.charge_tokens(
                principal.key_id, len(prompt) + params.max_tokens * params.n, param=options.max_tokens_param
            )
            deltas = self.engine.generate(servable.base, prompt, params, adapter=servable.adapter)
            first = await _first_delta(deltas)
        except APIError as error:
            record.status_code = error.status_code
            await self._save(record)
            raise
        response_id = f"{fmt.id_prefix}{secrets.token_hex(12)}"
        if options.stream:
            events = self._stream(response_id, model, fmt, options, first, deltas, record)
            return DisconnectAwareStreamingResponse(events, media_type="text/event-stream")
        try:
            body = await self._collect(request, response_id, model, fmt, options, first, deltas, record)
        finally:
            await self._save(record)
        return JSONResponse(body)

    async def _save(self, record: _Record) -> None:
        await self.rows.execute(INSERT_RECORD, record.row())

    async def _prepare(
        self, servable: ServableModel, fmt: Format, options: GenerationOptions
    ) -> tuple[list[int], SamplingParams]:
        try:
            tokenizer = await self.engine.tokenizer(servable.base)
            context = await self.engine.context_length(servable.base)
        except ModelLoadError as error:
            raise ServiceUnavailable(error.message, code="model_unavailable") from error
        prompt = fmt.prompt_token_ids(tokenizer)
        if not prompt:
            raise InvalidRequest(f"{fmt.prompt_param}: the prompt is empty.", param=fmt.prompt_param)
        if len(prompt) >= context:
            raise InvalidRequest(
                f"This model's maximum context length is {context} tokens; your {fmt.prompt_param} use "
                f"{len(prompt)} tokens, leaving no room for a completion.",
                param=fmt.prompt_param,
                code="context_length_exceeded",
            )
        max_tokens = options.max_tokens if options.max_tokens is not None else context - len(prompt)
        if len(prompt) + max_tokens > context:
            raise InvalidRequest(
                f"This model's maximum context length is {context} tokens; you requested {len(prompt) + max_tokens} "
                f"({len(prompt)} in the {fmt.prompt_param}, {max_tokens} for the completion). Lower "
                f"{options.max_tokens_param} or shorten the {fmt.prompt_param}.",
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
        )
        return prompt, params

    async def _collect(
        self,
        request: Request,
        response_id: str,
        model: str,
        fmt: Format,
        options: GenerationOptions,
        first: ChoiceDelta,
        deltas: AsyncIterator[ChoiceDelta],
        record: _Record,
    ) -> dict:
        choices = [_Choice() for _ in range(options.n)]

        async def consume() -> None:
            delta = first
            while True:
                _add(choices[delta.index], delta)
                delta = await anext(deltas, None)
                if delta is None:
                    return

        async def wait_for_disconnect() -> None:
            # `request.is_disconnected()` misses disconnects behind an HTTP middleware; a blocking receive does not.
            while (await request.receive())["type"] != "http.disconnect":
                pass

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(wait_for_disconnect())
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not consumer.done():
                # Nobody will read the answer: stop generating now.
                record.status_code = CLIENT_CLOSED_REQUEST
                consumer.cancel()
                await asyncio.gather(consumer, return_exceptions=True)
            if not consumer.cancelled():
                consumer.result()
        except EngineError as error:
            record.status_code = 500
            raise GenerationFailed(error.message) from error
        finally:
            for task in (consumer, watcher):
                if not task.done():
                    task.cancel()
            await asyncio.gather(consumer, watcher, return_exceptions=True)
            await deltas.aclose()
            record.completion_tokens = sum(choice.tokens for choice in choices)
        usage = _usage(record)
        return {
            "id": response_id,
            "object": fmt.object_name,
            "created": int(time.time()),
            "model": model,
            "choices": [fmt.choice(i, choice, options) for i, choice in enumerate(choices)],
            "usage": usage,
            "system_fingerprint": None,
        }

    async def _stream(
        self,
        response_id: str,
        model: str,
        fmt: Format,
        options: GenerationOptions,
        first: ChoiceDelta,
        deltas: AsyncIterator[ChoiceDelta],
        record: _Record,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        tokens = [0] * options.n

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            payload = {
                "id": response_id,
                "object": fmt.chunk_object_name,
                "created": created,
                "model": model,
                "choices": choices,
                "system_fingerprint": None,
            }
            if options.include_usage:
                payload["usage"] = usage
            return _sse(payload)

        record.status_code = CLIENT_CLOSED_REQUEST  # until the stream completes
        try:
            for opening in fmt.opening_chunks(options):
                yield chunk([opening])
            delta: ChoiceDelta | None = first
            while delta is not None:
                tokens[delta.index] = delta.completion_tokens
                record.completion_tokens = sum(tokens)
                yield chunk([fmt.chunk_choice(delta, options)])
                delta = await anext(deltas, None)
            if options.include_usage:
                yield chunk([], _usage(record))
            yield "data: [DONE]\n\n"
            record.status_code = 200
        except EngineError as error:
            # Headers are gone already: report the failure in the stream, as OpenAI does.
            record.status_code = 500
            yield _sse({"error": {"message": error.message, "type": "server_error", "param": None, "code": None}})
        finally:
            with anyio.CancelScope(shield=True):
                await deltas.aclose()
                await self._save(record)


@dataclass
class _Record:
    api_key_id: str
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
            "endpoint": self.endpoint,
            "requested_model": self.requested_model[:256],
            "model_version_id": self.model_version_id,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "latency_ms": (time.perf_counter() - self.started) * 1000,
            "status_code": self.status_code,
        }


def _add(choice: _Choice, delta: ChoiceDelta) -> None:
    choice.text.append(delta.text)
    choice.logprobs.extend(delta.logprobs)
    choice.tokens = delta.completion_tokens
    choice.finish_reason = delta.finish_reason or choice.finish_reason


def _usage(record: _Record) -> dict:
    return {
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "total_tokens": record.prompt_tokens + record.completion_tokens,
    }


async def _first_delta(deltas: AsyncIterator[ChoiceDelta]) -> ChoiceDelta:
    """Start generating and wait for the first output, so refusals still become proper HTTP errors."""
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
