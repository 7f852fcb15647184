"""`zaya db upgrade`, `zaya projects create|list`, `zaya keys create`, `zaya serve`, `zaya worker` and
`zaya models register`."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from command_line import CommandError
from server.db.models import DEFAULT_PROJECT_NAME, Role
from server.settings import Settings

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session


def _db_upgrade(args: argparse.Namespace) -> int:
    from server.db.migrations import upgrade

    settings = Settings()
    upgrade(settings.database_url, args.revision)
    print(f"database at revision {args.revision}: {settings.database_url}")
    return 0


@contextmanager
def _current_database(database_url: str) -> Iterator[Engine]:
    """An engine on the database, once its schema is known to be current; disposed of on leaving."""
    from server.db.migrations import schema_is_current
    from server.db.session import make_engine

    engine = make_engine(database_url)
    try:
        if not schema_is_current(engine):
            raise CommandError("the database schema is missing or out of date; run `zaya db upgrade` first")
        yield engine
    finally:
        engine.dispose()


def _audit_command(session: Session, *, action: str, command: str, target: str) -> None:
    """Record a command's action in the audit log as the API records the same action, with no acting key."""
    from server.services import audit

    audit.record(
        session,
        actor_key_id=None,
        project_id=None,
        action=action,
        method="CLI",
        path=command,
        target=target,
        status_code=200,
        client_address=None,
    )


def _keys_create(args: argparse.Namespace) -> int:
    from server.db.session import make_sessionmaker, session_scope
    from server.services.keys import create_key
    from server.services.projects import find_project

    with _current_database(Settings().database_url) as engine, session_scope(make_sessionmaker(engine)) as session:
        project = find_project(session, args.project)
        if project is None:
            raise CommandError(f"no project {args.project!r}; create it first: zaya projects create {args.project}")
        try:
            created = create_key(session, name=args.name, role=args.role, project_id=project.id)
        except ValueError as error:
            raise CommandError(str(error)) from error
        # As `POST /v1/admin/keys`: a key made here has no creating key (`created_by` is null).
        _audit_command(session, action="keys.create", command="zaya keys create", target=created.key.id)
    print(
        f"created {created.key.role} key {created.key.id} ({created.key.name}) in project {project.name}; "
        "the secret is shown only once:"
    )
    print(created.secret)
    return 0


def _projects_create(args: argparse.Namespace) -> int:
    from server.db.session import make_sessionmaker
    from server.errors import APIError
    from server.services.projects import create_project

    with _current_database(Settings().database_url) as engine, make_sessionmaker(engine)() as session:
        try:
            project = create_project(session, args.name)
        except APIError as error:
            raise CommandError(error.message) from error
    print(f"created project {project.name} ({project.id})")
    return 0


def _projects_list(_args: argparse.Namespace) -> int:
    from server.db.session import make_sessionmaker
    from server.services.projects import list_projects

    with _current_database(Settings().database_url) as engine, make_sessionmaker(engine)() as session:
        for project in list_projects(session):
            print(f"{project.id}\t{project.name}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from server.app import create_app
    from server.http_server import run_server

    settings = Settings()
    with _current_database(settings.database_url):
        pass  # only the check: the server opens its own engine
    run_server(create_app(settings), settings, host=args.host or settings.host, port=args.port or settings.port)
    return 0


def _worker(args: argparse.Namespace) -> int:
    import logging

    from server.db.session import make_sessionmaker
    from server.jobs.worker import Worker, WorkerConfig, install_signal_handlers
    from server.services import workers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        config = WorkerConfig(
            lease_seconds=args.lease_seconds,
            heartbeat_seconds=args.heartbeat_seconds,
            max_attempts=args.max_attempts,
            poll_seconds=args.poll_seconds,
        )
    except ValueError as error:
        raise CommandError(str(error)) from error
    settings = Settings()
    with _current_database(settings.database_url) as engine:
        worker = Worker(settings, make_sessionmaker(engine), config, worker_id=args.worker_id)
        install_signal_handlers(worker)
        devices = f"{worker.devices} {workers.DEVICE_NAMES[worker.device_kind]}"
        print(f"worker {worker.worker_id} ({devices} per job) polling {settings.database_url}", flush=True)
        worker.run_forever(exit_when_idle=args.exit_when_idle)
    return 0


def _models_register(args: argparse.Namespace) -> int:
    from pathlib import Path

    from server.db.session import make_sessionmaker, session_scope
    from server.errors import APIError
    from server.services import registry

    settings = Settings()
    with _current_database(settings.database_url) as engine, session_scope(make_sessionmaker(engine)) as session:
        try:
            version = registry.register_named_version(
                session,
                name=args.name,
                path=Path(args.dir),
                base_model=args.base,
                description=args.description,
                created_by=None,
                projects=[],
                serving=settings,
            )
        except APIError as error:
            raise CommandError(error.message) from error
        _audit_command(session, action="admin_models.register", command="zaya models register", target=version.id)
    print(f"registered {version.name} version {version.version} ({version.kind}); its id, for the admin API:")
    print(version.id)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    db = subparsers.add_parser("db", help="database schema").add_subparsers(dest="db_command", required=True)
    upgrade = db.add_parser("upgrade", help="apply Alembic migrations to ZAYA_DATABASE_URL")
    upgrade.add_argument("--revision", default="head", help="target revision (default: head)")
    upgrade.set_defaults(func=_db_upgrade)

    projects = subparsers.add_parser("projects", help="projects (each team's keys, files, jobs and models)")
    project_commands = projects.add_subparsers(dest="projects_command", required=True)
    create_project = project_commands.add_parser("create", help="create a project")
    create_project.add_argument("name", help="lower-case letters, digits, '-' and '_'")
    create_project.set_defaults(func=_projects_create)
    project_commands.add_parser("list", help="list projects: id and name").set_defaults(func=_projects_list)

    keys = subparsers.add_parser("keys", help="API keys").add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create an API key and print its secret once, on the last line")
    create.add_argument("--role", required=True, choices=[role.value for role in Role])
    create.add_argument("--name", required=True, help="who or what the key is for")
    create.add_argument(
        "--project", default=DEFAULT_PROJECT_NAME, help="the project (name or id) the key works in (default: default)"
    )
    create.set_defaults(func=_keys_create)

    serve = subparsers.add_parser("serve", help="run the API server (uvicorn)")
    serve.add_argument("--host", help="bind address (default: ZAYA_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: ZAYA_PORT or 8000)")
    serve.set_defaults(func=_serve)

    worker = subparsers.add_parser("worker", help="run the fine-tuning job worker (claims queued jobs)")
    worker.add_argument(
        "--lease-seconds",
        type=float,
        default=60.0,
        help="re-queue a silent worker's job after this",
    )
    worker.add_argument("--heartbeat-seconds", type=float, default=10.0, help="how often the lease is renewed")
    worker.add_argument("--max-attempts", type=int, default=3, help="lost leases before a job fails (default 3)")
    worker.add_argument("--poll-seconds", type=float, default=2.0, help="wait between empty polls of the queue")
    worker.add_argument("--worker-id", help="name in job events (default: host:pid)")
    worker.add_argument("--exit-when-idle", action="store_true", help="exit once the queue is empty")
    worker.set_defaults(func=_worker)

    models = subparsers.add_parser("models", help="model registry").add_subparsers(dest="models_command", required=True)
    register_model = models.add_parser("register", help="register a checkpoint or LoRA adapter dir as a new version")
    register_model.add_argument("dir", help="checkpoint dir (config.json) or adapter dir (adapter_config.json)")
    register_model.add_argument("--name", required=True, help="model name; the version number is the next free one")
    register_model.add_argument("--base", help="for adapters: the model it was trained on (name, name@alias, ...)")
    register_model.add_argument("--description", help="free text shown in the registry")
    register_model.set_defaults(func=_models_register)
