"""`zaya db upgrade`, `zaya keys create` and `zaya serve`."""

from __future__ import annotations

import argparse

from server.cli import CommandError
from server.db.models import Role
from server.settings import Settings


def _db_upgrade(args: argparse.Namespace) -> int:
    from server.db.migrations import upgrade

    settings = Settings()
    upgrade(settings.database_url, args.revision)
    print(f"database at revision {args.revision}: {settings.database_url}")
    return 0


def _require_current_schema(engine) -> None:
    from server.db.migrations import schema_is_current

    if not schema_is_current(engine):
        raise CommandError("the database schema is missing or out of date; run `zaya db upgrade` first")


def _keys_create(args: argparse.Namespace) -> int:
    from server.db.session import make_engine, make_sessionmaker, session_scope
    from server.services.keys import create_key

    engine = make_engine(Settings().database_url)
    try:
        _require_current_schema(engine)
        with session_scope(make_sessionmaker(engine)) as session:
            try:
                created = create_key(session, name=args.name, role=args.role)
            except ValueError as error:
                raise CommandError(str(error)) from error
    finally:
        engine.dispose()
    print(f"created {created.key.role} key {created.key.id} ({created.key.name}); the secret is shown only once:")
    print(created.secret)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from server.app import create_app
    from server.db.session import make_engine

    settings = Settings()
    engine = make_engine(settings.database_url)
    try:
        _require_current_schema(engine)
    finally:
        engine.dispose()
    uvicorn.run(create_app(settings), host=args.host or settings.host, port=args.port or settings.port)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    db = subparsers.add_parser("db", help="database schema").add_subparsers(dest="db_command", required=True)
    upgrade = db.add_parser("upgrade", help="apply Alembic migrations to ZAYA_DATABASE_URL")
    upgrade.add_argument("--revision", default="head", help="target revision (default: head)")
    upgrade.set_defaults(func=_db_upgrade)

    keys = subparsers.add_parser("keys", help="API keys").add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create an API key and print its secret once, on the last line")
    create.add_argument("--role", required=True, choices=[role.value for role in Role])
    create.add_argument("--name", required=True, help="who or what the key is for")
    create.set_defaults(func=_keys_create)

    serve = subparsers.add_parser("serve", help="run the API server (uvicorn)")
    serve.add_argument("--host", help="bind address (default: ZAYA_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: ZAYA_PORT or 8000)")
    serve.set_defaults(func=_serve)
