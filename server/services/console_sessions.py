"""Console sign-outs, kept in the database so a session's cookie is refused after sign-out by every server process,
also when a copy of the cookie survives (another tab, a stolen cookie)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from server.db.base import utcnow
from server.db.models import ConsoleSessionEnd


def end(session: Session, session_id: str, *, expires_at: datetime) -> None:
    """Record that the session ended (idempotent), and forget ended sessions past their lifetime. Commits."""
    now = utcnow()
    session.execute(delete(ConsoleSessionEnd).where(ConsoleSessionEnd.expires_at < now))
    if session.get(ConsoleSessionEnd, session_id) is None:
        session.add(ConsoleSessionEnd(session_id=session_id, ended_at=now, expires_at=expires_at))
    try:
        session.commit()
    except IntegrityError:  # signed out twice at once: the other request recorded it
        session.rollback()


def is_ended(session: Session, session_id: str) -> bool:
    query = select(ConsoleSessionEnd.session_id).where(ConsoleSessionEnd.session_id == session_id)
    return session.scalar(query) is not None
