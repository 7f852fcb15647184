"""Engines and sessions. SQLite runs in WAL mode with foreign keys on; PostgreSQL uses psycopg 3."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def make_engine(database_url: str, *, pre_ping: bool = True) -> Engine:
    """`pre_ping` tests each pooled connection before use (a round trip), so connections that died with a database
    restart are replaced transparently; hot paths that retry on a dead connection themselves turn it off."""
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=pre_ping)

    if url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    # Sessions move between the event loop and worker threads, one at a time.
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _configure_sqlite(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def make_autocommit_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose statements commit one by one, for single-statement reads on the hot path (authentication):
    no BEGIN and no ROLLBACK, which are a network round trip each on PostgreSQL."""
    return make_sessionmaker(engine.execution_options(isolation_level="AUTOCOMMIT"))


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session that commits on success and rolls back on any error."""
    with factory() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
