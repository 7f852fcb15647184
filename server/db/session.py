"""Engines and sessions. SQLite runs in WAL mode with foreign keys on; PostgreSQL uses psycopg 3."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from anyio import to_thread
from sqlalchemy import CursorResult, Engine, Result, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

if TYPE_CHECKING:
    from sqlalchemy.engine.interfaces import DBAPIConnection
    from sqlalchemy.pool import ConnectionPoolEntry

P = ParamSpec("P")
T = TypeVar("T")


def make_engine(database_url: str, *, pre_ping: bool = True, pool_size: int | None = None) -> Engine:
    """`pre_ping` tests each pooled connection before use (a round trip), so connections that died with a database
    restart are replaced transparently; hot paths that retry on a dead connection themselves turn it off.

    `pool_size` connections stay open (default SQLAlchemy's 5); under load as many again may be opened, which are
    closed when handed back to a full pool (on PostgreSQL each is a new server process: size pools for the load)."""
    url = make_url(database_url)
    pool = {} if pool_size is None else {"pool_size": pool_size, "max_overflow": pool_size}
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=pre_ping, **pool)

    if url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    else:
        pool = {}  # an in-memory database lives in its connection: SQLAlchemy keeps one per thread
    # Sessions move between the event loop and worker threads, one at a time.
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **pool)

    @event.listens_for(engine, "connect")
    def _configure_sqlite(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    return engine


def matched_rows(result: Result[Any]) -> int:
    """The rows an UPDATE or DELETE matched (`Session.execute` types its result as any statement's)."""
    if not isinstance(result, CursorResult):
        raise TypeError(f"not a DML statement's result: {type(result).__name__}")
    return result.rowcount


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def make_autocommit_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose statements commit one by one, for reads on the hot path (authentication, model resolution):
    no BEGIN and no ROLLBACK, which are a network round trip each on PostgreSQL."""
    return make_sessionmaker(engine.execution_options(isolation_level="AUTOCOMMIT"))


class RequestReads:
    """The reads every request makes (its key, its model): autocommit sessions on a pool without pre-ping (a round
    trip per checkout, on every request). A connection that died with a database restart is invalidated on first
    use, and the read runs once more on a fresh one.

    On SQLite they run on the event loop: a WAL reader never waits for a writer, and an indexed lookup takes a
    fraction of a millisecond of CPU, less than handing it to a pool thread costs under load (the thread and the busy
    event loop trade the GIL for every driver call, which costs more server CPU than the reads themselves). On
    PostgreSQL (a network round trip) they run in the thread pool."""

    def __init__(self, engine: Engine) -> None:
        self.sessions = make_autocommit_sessionmaker(engine)
        self._on_event_loop = engine.dialect.name == "sqlite"

    async def run(self, query: Callable[Concatenate[Session, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`query(session, ...)`'s result."""
        if self._on_event_loop:
            return self.read(query, *args, **kwargs)
        return await to_thread.run_sync(functools.partial(self.read, query, *args, **kwargs))

    def read(self, query: Callable[Concatenate[Session, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            with self.sessions() as session:
                return query(session, *args, **kwargs)
        except DBAPIError as error:
            if not error.connection_invalidated:
                raise
        with self.sessions() as session:
            return query(session, *args, **kwargs)


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
