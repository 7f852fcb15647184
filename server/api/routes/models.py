"""OpenAI `GET /v1/models` and `GET /v1/models/{model}`; `GET /v1/models/{model}/tokenizer`, its tokenizer's files."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response

from server.api.deps import AnalystDep, InferenceDep, SessionDep
from server.api.schemas import ListResponse, ModelObject
from server.services import models as model_service
from server.services.tokenizers import archive_name, tokenizer_archive

router = APIRouter(prefix="/v1/models", tags=["models"])

OWNER = "zaya"


@router.get("", name="models.list")
def list_models(session: SessionDep, _: AnalystDep) -> ListResponse[ModelObject]:
    data = [
        ModelObject(id=name, created=created, owned_by=OWNER) for name, created in model_service.list_model_ids(session)
    ]
    return ListResponse[ModelObject](data=data)


@router.get("/{model}", name="models.get")
def get_model(model: str, session: SessionDep, _: AnalystDep) -> ModelObject:
    name, created = model_service.get_model_id(session, model)
    return ModelObject(id=name, created=created, owned_by=OWNER)


@router.get(
    "/{model}/tokenizer",
    name="models.tokenizer",
    response_class=Response,
    responses={200: {"content": {"application/zip": {}}, "description": "The tokenizer's files, zipped."}},
)
async def get_tokenizer(model: str, inference: InferenceDep, _: AnalystDep) -> Response:
    """The tokenizer `model` is served with, as the files `AutoTokenizer.from_pretrained` reads (no weights), for
    clients that count tokens themselves (docs/clients.md). Any `model` a chat request takes."""
    tokenizer = await inference.tokenizer(model)
    archive = await asyncio.to_thread(tokenizer_archive, tokenizer)
    disposition = f'attachment; filename="{archive_name(model)}"'
    return Response(archive, media_type="application/zip", headers={"Content-Disposition": disposition})
