"""`RowWriter`: writes of concurrent requests committed together, each caller told its own write's outcome."""

from __future__ import annotations

import asyncio
import threading

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.exc import IntegrityError

from server.db import row_writer
from server.db.base import utcnow
from server.db.models import DEFAULT_PROJECT_ID, AuditLog, InferenceRecord
from server.db.row_writer import RowWriter
from server.db.session import make_engine
from server.services.audit import INSERT_ENTRY
from server.services.inference import INSERT_RECORD


@pytest.fixture
def engine(settings):
    engine = make_engine(settings.database_url)
    yield engine
    engine.dispose()


def audit_row(index: int) -> dict:
    return {
        "created_at": utcnow(),
        "actor_key_id": None,
        "action": f"test.{index}",
        "method": "POST",
        "path": "/v1/test",
        "target": None,
        "status_code": 200,
        "outcome": "success",
        "client_address": None,
    }


def record_row(api_key_id: str | None) -> dict:
    return {
        "created_at": utcnow(),
        "api_key_id": api_key_id,
        "project_id": DEFAULT_PROJECT_ID,
        "endpoint": "completions",
        "requested_model": "m",
        "model_version_id": None,
        "prompt_tokens": 1,
        "completion_tokens": 1,
        "latency_ms": 1.0,
        "status_code": 200,
    }


class FirstTransactionHeld:
    """Holds the writer's first transaction open until released, so the rows sent meanwhile wait in its queue."""

    def __init__(self, engine) -> None:
        self.transactions = 0
        self.started, self.release = threading.Event(), threading.Event()
        event.listen(engine, "begin", self._on_begin)

    def _on_begin(self, _connection) -> None:
        self.transactions += 1
        if self.transactions == 1:
            self.started.set()
            self.release.wait(timeout=30)


def count(engine, table) -> int:
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(table)).scalar_one()


@pytest.fixture
def held(engine) -> FirstTransactionHeld:
    return FirstTransactionHeld(engine)


async def hold_first_write(writer: RowWriter, held: FirstTransactionHeld) -> asyncio.Future:
    """Send one write and wait until the writer holds its transaction open: writes sent now queue behind it."""
    first = asyncio.ensure_future(writer.execute(INSERT_ENTRY, audit_row(0)))
    assert await asyncio.to_thread(held.started.wait, 30)
    return first


def test_concurrent_rows_are_committed_together_and_each_caller_waits_for_its_own(engine, held):
    writer = RowWriter(engine)

    async def scenario() -> None:
        first = await hold_first_write(writer, held)
        rest = [asyncio.ensure_future(writer.execute(INSERT_ENTRY, audit_row(i))) for i in range(1, 40)]
        rest.append(asyncio.ensure_future(writer.execute(INSERT_RECORD, record_row(None))))
        await asyncio.sleep(0.05)
        assert not any(task.done() for task in [first, *rest])  # nobody returns before the commit
        held.release.set()
        await asyncio.gather(first, *rest)

    asyncio.run(scenario())
    writer.close()
    # The first row alone, then the 40 rows that queued meanwhile in one transaction (two statements, two INSERTs).
    assert held.transactions == 2
    assert count(engine, AuditLog.__table__) == 40
    assert count(engine, InferenceRecord.__table__) == 1


def test_a_row_that_cannot_be_stored_fails_only_its_own_caller(engine, held):
    writer = RowWriter(engine)

    async def scenario() -> list:
        first = await hold_first_write(writer, held)
        # A key that does not exist: the foreign key refuses this row.
        bad = asyncio.ensure_future(writer.execute(INSERT_RECORD, record_row("key_missing")))
        good = [asyncio.ensure_future(writer.execute(INSERT_ENTRY, audit_row(i))) for i in range(1, 6)]
        await asyncio.sleep(0.05)
        held.release.set()
        return await asyncio.gather(first, bad, *good, return_exceptions=True)

    outcomes = asyncio.run(scenario())
    writer.close()
    assert isinstance(outcomes[1], IntegrityError)
    assert [outcome for index, outcome in enumerate(outcomes) if index != 1] == [None] * 6
    assert count(engine, AuditLog.__table__) == 6
    assert count(engine, InferenceRecord.__table__) == 0


def test_a_cancelled_caller_still_gets_its_row_written(engine, held):
    writer = RowWriter(engine)

    async def scenario() -> None:
        task = await hold_first_write(writer, held)
        task.cancel()
        held.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    writer.close()
    assert count(engine, AuditLog.__table__) == 1


def test_the_thread_ends_when_closed_or_idle_and_comes_back_for_the_next_row(engine, monkeypatch):
    monkeypatch.setattr(row_writer, "IDLE_EXIT_S", 0.05)
    writer = RowWriter(engine)
    others = set(threading.enumerate())  # other tests' writers may still be winding down

    def writer_threads() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate() if thread.name == "zaya-row-writer" and thread not in others]

    asyncio.run(writer.execute(INSERT_ENTRY, audit_row(0)))
    writer.close()
    assert writer_threads() == []
    asyncio.run(writer.execute(INSERT_ENTRY, audit_row(1)))
    [thread] = writer_threads()
    thread.join(timeout=10)  # idle past IDLE_EXIT_S
    assert not thread.is_alive()
    asyncio.run(writer.execute(INSERT_ENTRY, audit_row(2)))
    writer.close()
    assert count(engine, AuditLog.__table__) == 3
