"""Admin: the audit log, newest first, filterable by project, actor key, action and time."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from server.api.deps import AdminDep, ListingScopeDep, SessionDep
from server.api.schemas import AuditEntry, ListResponse
from server.errors import InvalidRequest
from server.services import audit as audit_service

router = APIRouter(prefix="/v1/admin/audit", tags=["admin"])


@router.get("", name="audit.list")
def list_audit(
    session: SessionDep,
    _: AdminDep,
    scope: ListingScopeDep,
    actor: Annotated[str | None, Query(description="API key id of the caller")] = None,
    action: Annotated[str | None, Query(description="e.g. files.create, keys.revoke")] = None,
    since: Annotated[datetime | None, Query(description="ISO 8601 time, inclusive")] = None,
    until: Annotated[datetime | None, Query(description="ISO 8601 time, exclusive")] = None,
    after: Annotated[int | None, Query(description="id of the last entry of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> ListResponse[AuditEntry]:
    for name, moment in (("since", since), ("until", until)):
        if moment is not None and moment.tzinfo is None:
            raise InvalidRequest(f"'{name}' needs a time zone, e.g. 2026-01-01T00:00:00Z.", param=name)
    entries = audit_service.list_entries(
        session, scope, actor=actor, action=action, since=since, until=until, after=after, limit=limit + 1
    )
    return ListResponse[AuditEntry](data=entries[:limit], has_more=len(entries) > limit)
