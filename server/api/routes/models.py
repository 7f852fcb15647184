"""OpenAI `GET /v1/models` and `GET /v1/models/{model}`."""

from __future__ import annotations

from fastapi import APIRouter

from server.api.deps import AnalystDep, ListingScopeDep, SessionDep
from server.api.schemas import ListResponse, ModelObject
from server.services import models as model_service

router = APIRouter(prefix="/v1/models", tags=["models"])

OWNER = "zaya"


@router.get("", name="models.list")
def list_models(session: SessionDep, _: AnalystDep, scope: ListingScopeDep) -> ListResponse[ModelObject]:
    data = [
        ModelObject(id=name, created=created, owned_by=OWNER)
        for name, created in model_service.list_model_ids(session, scope)
    ]
    return ListResponse[ModelObject](data=data)


@router.get("/{model}", name="models.get")
def get_model(model: str, session: SessionDep, principal: AnalystDep) -> ModelObject:
    name, created = model_service.get_model_id(session, principal.scope, model)
    return ModelObject(id=name, created=created, owned_by=OWNER)
