"""The bodies of `/v1/chat/completions` and `/v1/completions`, field for field OpenAI's, and their streamed chunks.

Whole answers are built as these models. Streamed chunks are declared by `ChatCompletionChunk` and
`CompletionChunk` (in `/openapi.json` under `text/event-stream`) but written by `ChunkWriter`, which encodes the
fields fixed for a stream once and each delta with one `json.dumps` of its text: building a model per token would
cost about as much again as the rest of the server's work per token. A test checks that every event it writes
validates as the declared chunk.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel

from server.engines.base import ChoiceDelta, TokenLogprob, ToolCallDelta
from server.services.inference import FinishedChoice

FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens taken from the engine's prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


# --- chat completions -------------------------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None

    @classmethod
    def of(cls, entries: list[TokenLogprob]) -> ChatChoiceLogprobs:
        return cls(content=[_chat_token_logprob(entry) for entry in entries])


class Function(BaseModel):
    name: str
    arguments: str  # JSON text


class ChatCompletionMessageToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: Function


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the answer is tool calls alone
    refusal: str | None = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None

    @classmethod
    def of(cls, choice: FinishedChoice) -> ChatCompletionMessage:
        if not choice.tool_calls:
            return cls(content=choice.text)
        calls = [
            ChatCompletionMessageToolCall(id=call.id, function=Function(name=call.name, arguments=call.arguments))
            for call in choice.tool_calls
        ]
        return cls(content=choice.text or None, tool_calls=calls)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None

    @classmethod
    def of(
        cls, id: str, created: int, model: str, choices: list[FinishedChoice], usage: Usage, *, logprobs: bool
    ) -> ChatCompletion:
        return cls(
            id=id,
            created=created,
            model=model,
            choices=[
                ChatCompletionChoice(
                    index=choice.index,
                    message=ChatCompletionMessage.of(choice),
                    logprobs=ChatChoiceLogprobs.of(choice.logprobs) if logprobs else None,
                    finish_reason=choice.finish_reason,
                )
                for choice in choices
            ],
            usage=usage,
        )


class ChoiceDeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ChoiceDeltaToolCall(BaseModel):
    """A piece of a streamed tool call: `id`, `type` and the function's `name` in its first, then its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChoiceDeltaFunction | None = None


class ChatCompletionDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ChoiceDeltaToolCall] | None = None


class ChatCompletionChunkChoice(BaseModel):
    index: int
    delta: ChatCompletionDelta
    logprobs: ChatChoiceLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion. `usage` is sent only with `stream_options.include_usage`:
    null on every chunk but the last, which has no choices."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None


# --- text completions -------------------------------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    """Per token: its text, its logprob and the most likely alternatives with it (null for an echoed prompt's first
    token, which nothing predicts), and where its text starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    @classmethod
    def of(cls, entries: list[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
        return cls.model_validate(_completion_logprobs(entries, offset))


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None

    @classmethod
    def of(
        cls, id: str, created: int, model: str, choices: list[FinishedChoice], usage: Usage, *, logprobs: bool
    ) -> Completion:
        return cls(
            id=id,
            created=created,
            model=model,
            choices=[
                CompletionChoice(
                    index=choice.index,
                    text=choice.text,
                    logprobs=CompletionLogprobs.of(choice.logprobs) if logprobs else None,
                    finish_reason=choice.finish_reason,
                )
                for choice in choices
            ],
            usage=usage,
        )


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class CompletionChunk(BaseModel):
    """One `data:` event of a streamed text completion; `usage` as in `ChatCompletionChunk`."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None


STREAMED_CHUNKS = (ChatCompletionChunk, CompletionChunk)


def event_stream(chunk: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI answer of a streamed request: `data:` events of `chunk` (a member of `STREAMED_CHUNKS`, which
    `server.api.openapi` adds to the document's schemas), then `data: [DONE]`."""
    return {
        "description": f"A whole answer, or with `stream: true` server-sent events: `data: <{chunk.__name__}>` "
        "for each chunk, then `data: [DONE]`.",
        "content": {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{chunk.__name__}"}}},
    }


# --- writing the stream -----------------------------------------------------------------------------------------

_encode = json.JSONEncoder(ensure_ascii=True, separators=(",", ":")).encode
DONE = "data: [DONE]\n\n"


class ChunkWriter:
    """The SSE events of one stream, as its chunk model declares them (keys in the model's order)."""

    def __init__(
        self,
        chunk: type[BaseModel],
        id: str,
        created: int,
        model: str,
        *,
        include_usage: bool,
        continuous_usage: bool = False,
        tool_calls: bool = False,
    ) -> None:
        """`include_usage`: chunks have a `usage` field, null until the last; `continuous_usage`: every chunk's
        `usage` is the usage so far (vLLM's `continuous_usage_stats`); `tool_calls`: the answer may be tool calls,
        whose content starts null rather than empty."""
        self.chat = chunk is ChatCompletionChunk
        self._opening_content = "null" if tool_calls else '""'
        head = _encode({"id": id, "object": chunk.model_fields["object"].default, "created": created, "model": model})
        self._prefix = f'data: {head[:-1]},"choices":['
        self._suffix = '],"system_fingerprint":null' + (',"usage":null}\n\n' if include_usage else "}\n\n")
        self._usage_suffix = '],"system_fingerprint":null,"usage":' if continuous_usage else None
        self._usage_prefix = f'data: {head[:-1]},"choices":[],"system_fingerprint":null,"usage":'
        self._offsets: dict[int, int] = {}  # text completions: characters of each choice's text sent so far

    def opening(self, n: int, usage: Usage | None = None) -> list[str]:
        """Chat streams open each choice with its role, as OpenAI's do."""
        if not self.chat:
            return []
        return [
            f'{self._prefix}{{"index":{index},"delta":{{"role":"assistant","content":{self._opening_content}}},'
            f'"logprobs":null,"finish_reason":null}}{self._end(usage)}'
            for index in range(n)
        ]

    def delta(self, delta: ChoiceDelta, *, logprobs: bool, usage: Usage | None = None) -> str:
        """A choice's delta; `usage` (the usage so far) with `continuous_usage`."""
        finish = "null" if delta.finish_reason is None else f'"{delta.finish_reason}"'
        entries = _encode(self._logprobs(delta)) if logprobs else "null"
        if self.chat:
            parts = [f'"content":{_encode(delta.text)}'] if delta.text else []
            if delta.tool_calls:
                parts.append(f'"tool_calls":{_encode([_tool_call_delta(call) for call in delta.tool_calls])}')
            output = f'"delta":{{{",".join(parts)}}}'
        else:
            output = f'"text":{_encode(delta.text)}'
            self._offsets[delta.index] = self._offsets.get(delta.index, 0) + len(delta.text)
        choice = f'{{"index":{delta.index},{output},"logprobs":{entries},"finish_reason":{finish}}}'
        return f"{self._prefix}{choice}{self._end(usage)}"

    def usage(self, usage: Usage) -> str:
        return f"{self._usage_prefix}{usage.model_dump_json()}}}\n\n"

    def _end(self, usage: Usage | None) -> str:
        if self._usage_suffix is None or usage is None:
            return self._suffix
        return f"{self._usage_suffix}{usage.model_dump_json()}}}\n\n"

    def _logprobs(self, delta: ChoiceDelta) -> dict[str, Any]:
        if self.chat:
            return {"content": [_chat_token_logprob(entry) for entry in delta.logprobs], "refusal": None}
        return _completion_logprobs(delta.logprobs, self._offsets.get(delta.index, 0))


def error_event(message: str) -> str:
    """A failure after the stream started (headers are gone): reported in the stream, as OpenAI does."""
    return f"data: {_encode({'error': {'message': message, 'type': 'server_error', 'param': None, 'code': None}})}\n\n"


def _tool_call_delta(call: ToolCallDelta) -> dict[str, Any]:
    """A streamed call's piece as OpenAI writes it: index, id, type and name first, then arguments alone."""
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    function = {"name": call.name, "arguments": call.arguments}
    return {"index": call.index, "id": call.id, "type": "function", "function": function}


def _chat_token_logprob(entry: TokenLogprob) -> dict[str, Any]:
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token.encode()),
        "top_logprobs": [
            {"token": token, "logprob": logprob, "bytes": list(token.encode())} for token, logprob in entry.top
        ],
    }


def _completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs from `offset` in the text: each position's alternatives include its own token (so
    the best of them equals its logprob exactly when the token was the most likely one)."""
    offsets, position = [], offset
    for entry in entries:
        offsets.append(position)
        position += len(entry.token)
    return {
        "tokens": [entry.token for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [
            None if entry.logprob is None else {**dict(entry.top), entry.token: entry.logprob} for entry in entries
        ],
        "text_offset": offsets,
    }
