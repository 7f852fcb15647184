"""The append-only audit log: rows are only ever inserted, and read back by admins with filters."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from server.db.base import utcnow
from server.db.models import AuditLog


def outcome_for(status_code: int) -> str:
    if status_code in (401, 403):
        return "denied"
    return "success" if status_code < 400 else "failure"


INSERT_ENTRY = insert(AuditLog)


def entry(
    *,
    actor_key_id: str | None,
    action: str,
    method: str,
    path: str,
    target: str | None,
    status_code: int,
    client_address: str | None,
) -> dict[str, Any]:
    """The column values of one audit log row, timed now (the request path writes them with `INSERT_ENTRY`)."""
    return {
        "created_at": utcnow(),
        "actor_key_id": actor_key_id,
        "action": action,
        "method": method,
        "path": path,
        "target": target,
        "status_code": status_code,
        "outcome": outcome_for(status_code),
        "client_address": client_address,
    }


def record(session: Session, **fields: Any) -> AuditLog:
    """Add an audit log row (the `entry` fields) to `session`'s transaction."""
    row = AuditLog(**entry(**fields))
    session.add(row)
    return row


def list_entries(
    session: Session,
    *,
    actor: str | None = None,
    action: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    after: int | None = None,
    limit: int = 100,
) -> list[AuditLog]:
    """Newest first; `after` is the id of the last entry of the previous page."""
    query = select(AuditLog).order_by(AuditLog.id.desc()).limit(limit)
    if actor is not None:
        query = query.where(AuditLog.actor_key_id == actor)
    if action is not None:
        query = query.where(AuditLog.action == action)
    if since is not None:
        query = query.where(AuditLog.created_at >= since)
    if until is not None:
        query = query.where(AuditLog.created_at < until)
    if after is not None:
        query = query.where(AuditLog.id < after)
    return list(session.scalars(query))
