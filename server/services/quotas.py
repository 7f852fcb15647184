"""Quotas (`Settings`; 0 turns one off): per project, its unfinished fine-tuning jobs and the bytes of its stored
files; per key, its generations in flight. A request beyond one gets 429 naming the quota, and nothing is stored or
started.

A project's quota is checked in the transaction that adds the job or file, with the project's row locked first, so
of two requests racing for the last place only one gets it: PostgreSQL locks the row (`FOR NO KEY UPDATE`, which
leaves inserts of rows pointing at the project free); SQLite, which runs one writer at a time, takes its write lock
with a write that changes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from server.db.models import ACTIVE_JOB_STATUSES, File, FineTuningJob, Project
from server.errors import QuotaExceeded

STREAMS_RETRY_AFTER_S = 1


def _lock_project(session: Session, project_id: str) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(Project.id).where(Project.id == project_id).with_for_update(key_share=True))
    else:
        session.execute(update(Project).where(Project.id == project_id).values(name=Project.name))


def check_jobs(session: Session, project_id: str, limit: int) -> None:
    """Refuse another job when the project has `limit` unfinished ones (validating, queued, running or paused)."""
    if not limit:
        return
    _lock_project(session, project_id)
    active = session.execute(
        select(func.count())
        .select_from(FineTuningJob)
        .where(
            FineTuningJob.project_id == project_id,
            FineTuningJob.status.in_([status.value for status in ACTIVE_JOB_STATUSES]),
        )
    ).scalar_one()
    if active >= limit:
        raise QuotaExceeded(
            f"The project has {active} unfinished fine-tuning jobs, its quota (ZAYA_PROJECT_MAX_CONCURRENT_JOBS = "
            f"{limit}). Wait for one to finish, or cancel one.",
            code="concurrent_jobs_quota_exceeded",
        )


def check_storage(session: Session, project_id: str, new_bytes: int, limit: int) -> None:
    """Refuse `new_bytes` more when the project's stored files would then hold more than `limit` bytes."""
    if not limit:
        return
    _lock_project(session, project_id)
    stored = session.execute(
        select(func.coalesce(func.sum(File.bytes), 0)).where(File.project_id == project_id, File.deleted_at.is_(None))
    ).scalar_one()
    if stored + new_bytes > limit:
        raise QuotaExceeded(
            f"The project stores {stored} bytes of files; {new_bytes} more would pass its quota "
            f"(ZAYA_PROJECT_MAX_STORED_BYTES = {limit}). Delete files it no longer needs.",
            code="storage_quota_exceeded",
        )


class OpenStreams:
    """Generations in flight per key, in this server process (each API process counts its own)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: Counter[str] = Counter()

    def open(self, key_id: str) -> Callable[[], None]:
        """Count one more for `key_id`, or refuse it at the limit; returns what closes it (once)."""
        if self.limit and self._open[key_id] >= self.limit:
            raise QuotaExceeded(
                f"This key has {self._open[key_id]} generations in flight, its quota (ZAYA_KEY_MAX_OPEN_STREAMS = "
                f"{self.limit}). Retry when one has finished.",
                code="open_streams_quota_exceeded",
                headers={"Retry-After": str(STREAMS_RETRY_AFTER_S)},
            )
        self._open[key_id] += 1
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                self._open[key_id] -= 1
                if not self._open[key_id]:
                    del self._open[key_id]

        return close

    def count(self, key_id: str) -> int:
        return self._open[key_id]
