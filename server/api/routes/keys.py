"""Admin: API keys (create, list, revoke), each in a project. A revoked key fails its very next request."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.api.deps import AdminDep, AdminKey, ListingScopeDep, SessionDep, set_audit_target
from server.api.schemas import ApiKeyCreate, ApiKeyCreated, ApiKeyObject, ListResponse
from server.db.models import DEFAULT_PROJECT_ID
from server.services import keys as key_service
from server.services.projects import require_project

router = APIRouter(prefix="/v1/admin/keys", tags=["admin"])


@router.post("", name="keys.create")
def create_key(body: ApiKeyCreate, request: Request, session: SessionDep, principal: AdminDep) -> ApiKeyCreated:
    project_id = require_project(session, body.project).id if body.project is not None else DEFAULT_PROJECT_ID
    created = key_service.create_key(
        session, name=body.name, role=body.role, created_by=principal.key_id, project_id=project_id
    )
    session.commit()
    set_audit_target(request, created.key.id)
    return ApiKeyCreated(**ApiKeyObject.model_validate(created.key).model_dump(), secret=created.secret)


@router.get("", name="keys.list")
def list_keys(session: SessionDep, _: AdminDep, scope: ListingScopeDep) -> ListResponse[ApiKeyObject]:
    return ListResponse[ApiKeyObject](data=key_service.list_keys(session, scope))


@router.post("/{key_id}/revoke", name="keys.revoke")
def revoke_key(key: AdminKey, session: SessionDep) -> ApiKeyObject:
    key_service.revoke_key(session, key)
    session.commit()
    return ApiKeyObject.model_validate(key)
