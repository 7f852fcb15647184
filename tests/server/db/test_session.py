"""The embedded default: SQLite in WAL mode with foreign keys enforced."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, StatementError

from server.db.migrations import upgrade
from server.db.models import DEFAULT_PROJECT_ID, ApiKey, File
from server.db.session import RequestReads, make_engine, make_sessionmaker
from server.settings import Settings


def test_default_database_is_sqlite_under_the_data_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("ZAYA_DATABASE_URL", raising=False)
    monkeypatch.setenv("ZAYA_DATA_DIR", str(tmp_path / "var"))
    assert Settings().database_url == f"sqlite:///{tmp_path / 'var' / 'zaya.db'}"


def test_sqlite_runs_in_wal_mode_with_foreign_keys(tmp_path):
    url = f"sqlite:///{tmp_path / 'nested' / 'zaya.db'}"
    upgrade(url)
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert connection.execute(text("PRAGMA foreign_keys")).scalar() == 1
        with make_sessionmaker(engine)() as session:
            session.add(
                File(
                    filename="a",
                    purpose="fine-tune",
                    bytes=1,
                    sha256="0" * 64,
                    created_by="key_missing",
                    project_id=DEFAULT_PROJECT_ID,
                )
            )
            with pytest.raises(IntegrityError):
                session.commit()
    finally:
        engine.dispose()


def test_timestamps_come_back_timezone_aware_and_naive_ones_are_refused(sessions):
    with sessions() as session:
        key = ApiKey(name="n", role="admin", prefix="zk-timestamp", secret_hash="0" * 64, project_id=DEFAULT_PROJECT_ID)
        session.add(key)
        session.commit()
        session.expire_all()
        assert session.get(ApiKey, key.id).created_at.tzinfo is UTC
        key.last_used_at = datetime(2026, 1, 1)
        with pytest.raises(StatementError, match="naive"):
            session.commit()


def test_request_reads_run_on_the_event_loop_on_sqlite_only(settings):
    """SQLite reads stay on the event loop (no GIL handoffs to a pool thread); PostgreSQL's go to the thread pool."""
    engine = make_engine(settings.database_url, pre_ping=False)
    reads = RequestReads(engine)

    def read(session) -> int:
        session.execute(text("SELECT 1"))
        return threading.get_ident()

    async def threads() -> tuple[int, int]:
        return threading.get_ident(), await reads.run(read)

    try:
        loop_thread, read_thread = asyncio.run(threads())
    finally:
        engine.dispose()
    assert (read_thread == loop_thread) == (engine.dialect.name == "sqlite")
