"""OpenAI's `POST /v1/chat/completions` and `POST /v1/completions` (legacy text completions)."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.deps import AnalystDep, InferenceDep
from server.api.inference.protocol import ChatCompletionRequest, CompletionRequest
from server.api.inference.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    event_stream,
)
from server.api.inference.serving import answer

router = APIRouter(tags=["inference"])


@router.post(
    "/v1/chat/completions",
    name="chat.completions",
    response_model=ChatCompletion,
    responses={200: event_stream(ChatCompletionChunk)},
)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, principal: AnalystDep, service: InferenceDep
) -> ChatCompletion | Completion | Response:
    generation = await service.start_generation(principal.key_id, body)
    return await answer(request, generation, body, kind=ChatCompletion, response_id=f"chatcmpl-{secrets.token_hex(12)}")


@router.post(
    "/v1/completions",
    name="completions",
    response_model=Completion,
    responses={200: event_stream(CompletionChunk)},
)
async def create_completion(
    body: CompletionRequest, request: Request, principal: AnalystDep, service: InferenceDep
) -> ChatCompletion | Completion | Response:
    generation = await service.start_generation(principal.key_id, body)
    return await answer(request, generation, body, kind=Completion, response_id=f"cmpl-{secrets.token_hex(12)}")
