"""A `Generation` (`server.services.inference`) as an HTTP answer: a whole body, or an SSE stream ending in
`data: [DONE]`; in both, a client that leaves cancels the generation.

Starlette notices a client leaving only while it reads the request, so both answers keep listening on `receive`
(`request.is_disconnected()` misses disconnects behind an HTTP middleware; a blocking receive does not).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from server.api.inference.protocol import SamplingRequest
from server.api.inference.responses import (
    DONE,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkWriter,
    Completion,
    CompletionChunk,
    Usage,
    error_event,
)
from server.errors import GenerationFailed
from server.services.inference import CLIENT_CLOSED_REQUEST, Generation

T = TypeVar("T")


class DisconnectAwareStreamingResponse(StreamingResponse):
    """Streams while listening for the client leaving; then closes the body iterator and calls `on_close`.

    Starlette's own response stops listening under ASGI 2.4 and leaves the iterator for the garbage collector.
    """

    def __init__(
        self, content: AsyncGenerator[str, None], *, on_close: Callable[[], Awaitable[None]], **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self.content = content  # Starlette's `body_iterator`, typed as any async iterable
        self.on_close = on_close

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
                await self.content.aclose()
                await self.on_close()  # also when the stream was cut before its first event


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client leaves first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def answer(
    request: Request,
    generation: Generation,
    body: SamplingRequest,
    *,
    kind: type[ChatCompletion] | type[Completion],
    response_id: str,
) -> ChatCompletion | Completion | Response:
    """The generation of `body` as `kind` (a chat or a text completion), whole or streamed as its chunks."""
    created = int(time.time())
    logprobs = body.logprob_alternatives() is not None
    if body.stream:
        chunk = ChatCompletionChunk if kind is ChatCompletion else CompletionChunk
        writer = ChunkWriter(
            chunk,
            response_id,
            created,
            body.model,
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            tool_calls=body.parses_tool_calls,
        )
        events = _events(generation, writer, body, logprobs=logprobs)
        return DisconnectAwareStreamingResponse(events, on_close=generation.aclose, media_type="text/event-stream")
    async with generation:
        choices = await unless_disconnected(request, generation.collect())
    if choices is None:  # nobody reads this answer
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return kind.of(response_id, created, body.model, choices, _usage(generation), logprobs=logprobs)


def _usage(generation: Generation) -> Usage:
    return Usage.of(generation.prompt_tokens, generation.completion_tokens, generation.cached_tokens)


async def _events(
    generation: Generation, writer: ChunkWriter, body: SamplingRequest, *, logprobs: bool
) -> AsyncGenerator[str, None]:
    continuous = body.continuous_usage
    async with generation:
        for event in writer.opening(generation.n, _usage(generation) if continuous else None):
            yield event
        try:
            async with contextlib.aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    yield writer.delta(delta, logprobs=logprobs, usage=_usage(generation) if continuous else None)
        except GenerationFailed as error:
            yield error_event(error.message)
            return
        if body.include_usage:
            yield writer.usage(_usage(generation))
        yield DONE
