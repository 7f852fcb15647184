"""Two promotions of one alias racing in two transactions (two API servers, two admins): one wins, the other is
refused by the database's unique move number, and the history holds one entry for the move."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError

from server.db.models import AliasHistory, ModelVersion
from server.errors import Conflict
from server.services import registry
from server.services.access import Scope
from server.services.model_resolution import find_version


def wait_until_waiting(sessions, backend: threading.Event, pid: list[int]) -> None:
    """Until the racing transaction waits for a lock (PostgreSQL: its backend's wait event); SQLite shows no
    waiters, so the racer is given a second to reach its blocked write."""
    assert backend.wait(30)
    with sessions() as session:
        if session.get_bind().dialect.name != "postgresql":
            time.sleep(1.0)
            return
        query = text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid")
        deadline = time.monotonic() + 30
        while session.scalar(query, {"pid": pid[0]}) != "Lock":
            assert time.monotonic() < deadline, "the second promotion never waited for the first"
            session.rollback()  # a fresh snapshot of pg_stat_activity
            time.sleep(0.02)


def test_two_racing_promotions_of_one_alias_cannot_both_win(sessions, tiny_model_dir):
    with sessions() as session:
        held, first, second = (registry.register_version(session, name="zaya-tiny", path=tiny_model_dir) for _ in "abc")
        registry.promote(session, held, reason="start", actor=None, gate=False)
        session.commit()
    outcome: dict[str, object] = {}
    backend, pid = threading.Event(), []

    def promote_second() -> None:
        with sessions() as session:
            if session.get_bind().dialect.name == "postgresql":
                pid.append(session.scalar(text("SELECT pg_backend_pid()")))
            backend.set()
            try:
                # Reads the holder now, before the first promotion commits, and then waits for its write lock.
                registry.promote(session, session.get(ModelVersion, second.id), reason="second", actor=None, gate=False)
                session.commit()
                outcome["second"] = "won"
            except Conflict as error:
                outcome["second"] = error

    with sessions() as session:
        registry.promote(session, session.get(ModelVersion, first.id), reason="first", actor=None, gate=False)
        racer = threading.Thread(target=promote_second)
        racer.start()
        wait_until_waiting(sessions, backend, pid)
        session.commit()
    racer.join(timeout=60)

    refused = outcome["second"]
    assert isinstance(refused, Conflict), refused
    assert refused.code == "alias_moved" and "concurrent request" in refused.message
    with sessions() as session:
        assert find_version(session, Scope.everything(), "zaya-tiny@production").id == first.id
        history = session.scalars(select(AliasHistory).order_by(AliasHistory.id)).all()
        assert [(entry.to_version_id, entry.sequence) for entry in history] == [(held.id, 1), (first.id, 2)]


def test_the_move_number_is_unique_per_alias(sessions, tiny_model_dir):
    with sessions() as session:
        version = registry.register_version(session, name="zaya-tiny", path=tiny_model_dir)
        entry = registry.promote(session, version, reason="one", actor=None, gate=False)
        session.commit()
        session.add(AliasHistory(model_name="zaya-tiny", alias="production", action="promote", sequence=entry.sequence))
        with pytest.raises(IntegrityError):
            session.flush()
