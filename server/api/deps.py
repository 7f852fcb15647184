"""Typed dependencies: settings, a database session, the inference service, the calling API key and role checks.

Authentication itself runs in `server.api.middleware` before routing (so even a malformed body without a key gets
401); these dependencies read its result and enforce the role each route needs. Dependencies that do no I/O are
`async def`: FastAPI runs a plain `def` dependency in its thread pool, a thread hop per dependency per request.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from server.db.models import ApiKey, Role
from server.errors import Forbidden, Unauthorized
from server.services.inference import InferenceService
from server.settings import Settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Principal:
    """The authenticated caller: the key's id, name and role (never its secret or hash)."""

    key_id: str
    name: str
    role: Role

    @classmethod
    def from_key(cls, key: ApiKey) -> Principal:
        return cls(key_id=key.id, name=key.name, role=Role(key.role))


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


def set_audit_target(request: Request, target: str) -> None:
    """Name the object a mutating request acted on, for its audit log entry."""
    request.state.audit_target = target
