"""OpenAI `POST /v1/chat/completions`: the request schema and the route; the work is `server.services.inference`."""

from __future__ import annotations

import secrets
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from server.api.completion_schemas import ChatCompletion, ChatCompletionChunk, event_stream
from server.api.deps import AnalystDep, InferenceDep
from server.api.generation import answer
from server.services.inference import ChatPrompt, GenerationOptions

router = APIRouter(tags=["inference"])

MAX_N = 16
MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 200
MAX_TOP_LOGPROBS = 20


def _valid_unicode(value):
    """JSON may carry lone surrogate escapes ("\\ud800"): they decode to strings no tokenizer or database encodes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"contains a lone surrogate (\\u{ord(value[error.start]):04x}) at position {error.start}, "
                "which is not valid Unicode"
            ) from None
    return value


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("contains a NUL character")
    return value


# Request text: a str that is valid Unicode (checked first, so the error says what is wrong).
Text = Annotated[str, BeforeValidator(_valid_unicode)]
# A model name is looked up and recorded: no NUL (PostgreSQL text cannot hold one).
ModelName = Annotated[Text, AfterValidator(_no_nul), Field(min_length=1, max_length=256)]
StopSequence = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_LENGTH)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    # OpenAI sends more fields (name, tool calls); this model answers with text only.
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class SamplingFields(BaseModel):
    """Fields chat and completions share, with OpenAI's ranges; unknown fields are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    model: ModelName
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: StopSequence | list[StopSequence] | None = Field(default=None)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra parameter: generate past end-of-sequence tokens, to exactly the token limit (benchmarks).
    ignore_eos: bool = Field(default=False, strict=True)

    @field_validator("stop")
    @classmethod
    def _few_stop_sequences(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        return stop

    @property
    def include_usage(self) -> bool:
        """A streamed answer ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def options(self) -> GenerationOptions:
        # `max_completion_tokens` replaces the deprecated `max_tokens`; either names the field in errors.
        limit_param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return GenerationOptions(
            max_tokens=self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens,
            max_tokens_param=limit_param,
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop_sequences(),
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            ignore_eos=self.ignore_eos,
        )


@router.post(
    "/v1/chat/completions",
    name="chat.completions",
    response_model=ChatCompletion,
    responses={200: event_stream(ChatCompletionChunk)},
)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, principal: AnalystDep, service: InferenceDep
):
    prompt = ChatPrompt([message.as_template_input() for message in body.messages])
    generation = await service.start_generation(principal, body.model, prompt, body.options())
    return await answer(
        request,
        generation,
        kind=ChatCompletion,
        response_id=f"chatcmpl-{secrets.token_hex(12)}",
        model=body.model,
        stream=body.stream,
        include_usage=body.include_usage,
        logprobs=body.logprobs,
    )
