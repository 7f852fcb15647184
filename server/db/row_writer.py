"""The request path's writes (audit entries, inference records, a key's last use), committed in batches by one
thread.

A transaction per write in Starlette's thread pool costs far more than the write under load: SQLAlchemy running in
pool threads beside the busy event loop hands the GIL back and forth for every driver call, and each write pays a
transaction (a connection check, BEGIN and COMMIT: three round trips on PostgreSQL). Batched on one thread, an
inference request's inserts cost the server a small fraction of that CPU.

`RowWriter` is group commit: one thread takes every write waiting at that moment and runs them in one transaction,
each run of writes of the same statement as one executemany (a multi-row INSERT). Statements are module constants,
so writes of one kind share a statement object. A caller awaits the commit of its own write, so a response is
sent only once its rows are on disk. When a batch fails, its writes are retried one by one, so a row that cannot be
stored (or its error) never fails another request's write. The thread starts on the first write and ends after a
few idle seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, Executable

IDLE_EXIT_S = 5.0
MAX_BATCH_ROWS = 512


@dataclass(frozen=True)
class _Pending:
    statement: Executable
    params: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    committed: asyncio.Future[None]


_STOP = object()  # queued by `close`


class RowWriter:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._queue: queue.SimpleQueue[_Pending | object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    async def execute(self, statement: Executable, params: dict[str, Any]) -> None:
        """Run `statement` with `params`; returns once it is committed, raises what running it raised."""
        loop = asyncio.get_running_loop()
        committed: asyncio.Future[None] = loop.create_future()
        self._queue.put(_Pending(statement, params, loop, committed))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="zaya-row-writer", daemon=True)
                self._thread.start()
        await committed

    def close(self) -> None:
        """Run every write handed over so far, then end the thread."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            self._queue.put(_STOP)
        thread.join()

    def _run(self) -> None:
        while True:
            batch, stop = self._next_batch()
            if batch:
                _settle(batch, self._write(batch))
            if stop:
                with self._lock:
                    # `execute` queues a write before it looks for the thread: one queued by now is seen here, and
                    # one queued later starts a new thread.
                    if self._queue.empty():
                        self._thread = None
                        return

    def _next_batch(self) -> tuple[list[_Pending], bool]:
        """The writes waiting now (the first one waited for), and whether the thread may end after them."""
        try:
            item = self._queue.get(timeout=IDLE_EXIT_S)
        except queue.Empty:
            return [], True
        batch: list[_Pending] = []
        while isinstance(item, _Pending):  # else `_STOP`
            batch.append(item)
            if len(batch) == MAX_BATCH_ROWS:
                return batch, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, False
        return batch, True

    def _write(self, batch: list[_Pending]) -> list[Exception | None]:
        try:
            self._run_in_one_transaction(batch)
        except Exception as error:
            if len(batch) == 1:
                return [error]
            return [self._write_alone(item) for item in batch]
        return [None] * len(batch)

    def _write_alone(self, item: _Pending) -> Exception | None:
        try:
            self._run_in_one_transaction([item])
        except Exception as error:
            return error
        return None

    def _run_in_one_transaction(self, batch: list[_Pending]) -> None:
        with self._engine.begin() as connection:
            for statement, pending in itertools.groupby(batch, key=lambda item: item.statement):
                connection.execute(statement, [item.params for item in pending])


def _settle(batch: list[_Pending], errors: list[Exception | None]) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[None], Exception | None]]] = {}
    for item, error in zip(batch, errors, strict=True):
        by_loop.setdefault(item.loop, []).append((item.committed, error))
    for loop, outcomes in by_loop.items():
        with contextlib.suppress(RuntimeError):  # that event loop has closed: nobody waits any more
            loop.call_soon_threadsafe(_resolve, outcomes)


def _resolve(outcomes: list[tuple[asyncio.Future[None], Exception | None]]) -> None:
    for committed, error in outcomes:
        if committed.done():  # the caller was cancelled (its client left)
            continue
        if error is None:
            committed.set_result(None)
        else:
            committed.set_exception(error)
