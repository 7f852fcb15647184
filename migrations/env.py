"""Alembic environment: the target is `server.db.models`; the URL comes from the caller or the ZAYA_* settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

import server.db.models  # noqa: F401  (registers every table on Base.metadata)
from server.db.base import Base
from server.db.session import make_engine
from server.settings import Settings

config = context.config
target_metadata = Base.metadata


def _database_url() -> str:
    return config.get_main_option("sqlalchemy.url") or Settings().database_url


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )


def run_migrations_offline() -> None:
    context.configure(url=_database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_database_url())
    try:
        with engine.connect() as connection:
            sqlite = connection.dialect.name == "sqlite"
            if sqlite:
                # Batch mode rebuilds a table by copying it, dropping the original and renaming the copy; with foreign
                # keys enforced, dropping a table that other rows point at fails. Off while migrating (a PRAGMA takes
                # effect outside a transaction only), and every reference is checked afterwards.
                connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
                connection.commit()
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
            if sqlite:
                _check_foreign_keys(connection)
    finally:
        engine.dispose()


def _check_foreign_keys(connection: Connection) -> None:
    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
    connection.commit()
    if broken:
        raise RuntimeError(f"the migrated database has rows pointing at missing rows: {broken[:10]}")


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
