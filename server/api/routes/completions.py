"""OpenAI `POST /v1/completions` (legacy text completions): one prompt, as text or token ids."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request
from pydantic import Field, field_validator

from server.api.completion_schemas import Completion, CompletionChunk, event_stream
from server.api.deps import AnalystDep, InferenceDep
from server.api.generation import answer
from server.api.routes.chat import SamplingFields, Text
from server.services.inference import GenerationOptions, TextPrompt

router = APIRouter(tags=["inference"])

MAX_LOGPROBS = 5  # OpenAI's limit for the legacy endpoint


class CompletionRequest(SamplingFields):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for this endpoint
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        # A list of prompts (batch) is OpenAI-legal but not served here: one prompt per request.
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported; send one request per prompt")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    def options(self) -> GenerationOptions:
        return GenerationOptions(
            max_tokens=self.max_tokens,
            max_tokens_param="max_tokens",
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop_sequences(),
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            ignore_eos=self.ignore_eos,
        )


@router.post(
    "/v1/completions",
    name="completions",
    response_model=Completion,
    responses={200: event_stream(CompletionChunk)},
)
async def create_completion(body: CompletionRequest, request: Request, principal: AnalystDep, service: InferenceDep):
    generation = await service.start_generation(principal, body.model, TextPrompt(body.prompt), body.options())
    return await answer(
        request,
        generation,
        kind=Completion,
        response_id=f"cmpl-{secrets.token_hex(12)}",
        model=body.model,
        stream=body.stream,
        include_usage=body.include_usage,
        logprobs=body.logprobs is not None,
    )
