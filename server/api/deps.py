"""Typed dependencies: settings, a database session, the inference service, the calling API key, role checks, and
the objects a request names, looked up within the caller's project (`server.services.access`).

Authentication itself runs in `server.api.middleware` before routing (so even a malformed body without a key gets
401); these dependencies read its result and enforce the role each route needs. A route that takes a file or a job by
id declares `OwnedFile` / `OwnedJob`: the role check, then the lookup in the caller's scope (404 for another project's
object, as for a missing one); an admin route that takes a model version, an approval request, a project or a key by
id declares `AdminVersion` / `AdminApproval` / `AdminProject` / `AdminKey`: the admin role check, then the lookup (404
for a missing one). Dependencies that do no I/O are `async def`: FastAPI runs a plain `def` dependency in its thread
pool, a thread hop per dependency per request.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated

from fastapi import Depends, Query, Request
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from server.db.models import AliasApproval, ApiKey, File, FineTuningJob, ModelVersion, Project, Role
from server.errors import Forbidden, InvalidRequest, Unauthorized
from server.services import approvals as approval_service
from server.services import files as file_service
from server.services import jobs as job_service
from server.services import keys as key_service
from server.services import projects as project_service
from server.services import registry as registry_service
from server.services.access import Principal, Scope
from server.services.inference import InferenceService
from server.services.projects import find_project
from server.settings import Settings

logger = logging.getLogger(__name__)


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    session = request.app.state.sessionmaker()
    try:
        yield session
    finally:
        # Runs once the answer is decided, possibly after it started: a database that went away in between
        # (the rollback on close fails) must not break that answer. The dead connection is dropped from the pool.
        try:
            session.close()
        except SQLAlchemyError as error:
            reason = str(getattr(error, "orig", None) or error).splitlines()[0]
            logger.warning("closing a database session failed (%s); dropping its connection", reason)
            with contextlib.suppress(SQLAlchemyError):
                session.invalidate()


async def get_inference(request: Request) -> InferenceService:
    inference: InferenceService = request.app.state.inference
    return inference


async def get_principal(request: Request) -> Principal:
    principal: Principal | None = getattr(request.state, "principal", None)
    if principal is None:
        raise Unauthorized("Missing or invalid API key.", code="invalid_api_key")
    return principal


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
InferenceDep = Annotated[InferenceService, Depends(get_inference)]


def require_role(role: Role) -> Callable[[Principal], Awaitable[Principal]]:
    async def check(principal: PrincipalDep) -> Principal:
        if not principal.role.allows(role):
            raise Forbidden(f"This endpoint requires the '{role}' role; your key has '{principal.role}'.")
        return principal

    return check


AnalystDep = Annotated[Principal, Depends(require_role(Role.analyst))]
DataDep = Annotated[Principal, Depends(require_role(Role.data))]
AdminDep = Annotated[Principal, Depends(require_role(Role.admin))]


async def listing_scope(
    principal: PrincipalDep,
    session: SessionDep,
    project: Annotated[
        str | None,
        Query(description="a project's id or name: list what that project sees (other than admin keys: your own)"),
    ] = None,
) -> Scope:
    """What a list shows: the caller's scope, or (admin keys) the one project named by `project`. A key naming a
    project other than its own gets the answer an unknown project gets."""
    if not project:  # absent, or left empty in a form
        return principal.scope
    found = await run_in_threadpool(find_project, session, project)
    if found is None or not principal.scope.includes(found.id):
        raise InvalidRequest(f"No such project: {project}", param="project", code="project_not_found")
    return Scope(found.id)


ListingScopeDep = Annotated[Scope, Depends(listing_scope)]


def owned_file(file_id: str, session: SessionDep, principal: DataDep) -> File:
    return file_service.get_file(session, principal.scope, file_id)


def owned_job(fine_tuning_job_id: str, session: SessionDep, principal: DataDep) -> FineTuningJob:
    return job_service.get_job(session, principal.scope, fine_tuning_job_id)


def admin_version(version_id: str, session: SessionDep, _: AdminDep) -> ModelVersion:
    return registry_service.get_version(session, version_id)


def admin_approval(approval_id: str, session: SessionDep, _: AdminDep) -> AliasApproval:
    return approval_service.get_approval(session, approval_id)


def admin_project(project_id: str, session: SessionDep, _: AdminDep) -> Project:
    return project_service.get_project(session, project_id)


def admin_key(key_id: str, session: SessionDep, _: AdminDep) -> ApiKey:
    return key_service.get_key(session, key_id)


OwnedFile = Annotated[File, Depends(owned_file)]
OwnedJob = Annotated[FineTuningJob, Depends(owned_job)]
# The registry, projects and keys are the admins': looked up after the admin role check, in every project.
AdminVersion = Annotated[ModelVersion, Depends(admin_version)]
AdminApproval = Annotated[AliasApproval, Depends(admin_approval)]
AdminProject = Annotated[Project, Depends(admin_project)]
AdminKey = Annotated[ApiKey, Depends(admin_key)]


def set_audit_target(request: Request, target: str) -> None:
    """Name the object a mutating request acted on, for its audit log entry."""
    request.state.audit_target = target
