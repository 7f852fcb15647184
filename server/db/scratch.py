"""Throwaway databases for tests and benchmarks: a new SQLite file, or a new schema in a PostgreSQL server that is
dropped afterwards (so runs on one server never see each other's rows)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import make_url

from server.db.session import make_engine


@contextmanager
def scratch_database(directory: Path, server_url: str | None = None) -> Iterator[str]:
    """The URL of an empty database: an SQLite file in `directory`, or a schema of its own in the PostgreSQL server
    at `server_url` (its connections find it first on their search path)."""
    if not server_url:
        yield f"sqlite:///{directory / f'scratch-{secrets.token_hex(4)}.db'}"
        return
    schema = f"zaya_scratch_{secrets.token_hex(6)}"
    admin = make_engine(server_url)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        url = make_url(server_url).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
