"""`zaya run`: the whole embedded stack on one machine (what `make run` starts).

1. `db upgrade` on `ZAYA_DATABASE_URL` (SQLite under `ZAYA_DATA_DIR` by default);
2. a servable model: if no full model version is registered, a tiny ZAYA model and tokenizer are pretrained on
   synthetic bank chats in seconds (`finetune/bootstrap.py`), saved atomically under `<data dir>/models/`, registered
   and aliased `production`;
3. the API on 127.0.0.1:8000 plus a worker process (`zaya worker`). Ctrl-C stops both.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

from command_line import CommandError
from finetune.bootstrap import build_tiny_model
from server.engines.threads import run_on_own_thread
from server.settings import Settings

BOOTSTRAP_MODEL_NAME = "zaya-tiny"
WORKER_STOP_TIMEOUT_S = 30


def ensure_local_model(settings: Settings, *, train_steps: int | None = None) -> str:
    """The model name to chat with: an existing full model version, else a freshly bootstrapped one."""
    from sqlalchemy import select

    from server.db.models import ModelVersion
    from server.db.session import make_engine, make_sessionmaker, session_scope
    from server.services import registry

    engine = make_engine(settings.database_url)
    try:
        sessions = make_sessionmaker(engine)
        with sessions() as session:
            existing = session.scalars(
                select(ModelVersion.name)
                .where(ModelVersion.kind == "full", ModelVersion.status == "active")
                .order_by(ModelVersion.created_at)
                .limit(1)
            ).first()
        if existing is not None:
            print(f"model: using the registered model '{existing}'")
            return existing
        directory = (settings.data_dir / "models" / BOOTSTRAP_MODEL_NAME).resolve()
        if not (directory / "config.json").is_file():  # a finished earlier bootstrap is reused
            print(f"model: none registered; training a tiny ZAYA model on synthetic bank cases into {directory} ...")
            # Off this thread: the API server started next would otherwise decode slower (`server.engines.threads`).
            run_on_own_thread(build_tiny_model, directory, train_steps=train_steps)
        with session_scope(sessions) as session:
            version = registry.register_version(
                session,
                name=BOOTSTRAP_MODEL_NAME,
                path=directory,
                description="Tiny ZAYA model bootstrapped by `zaya run` (synthetic bank corpus).",
                serving=settings,
            )
            registry.promote(
                session, version, alias=registry.DEFAULT_ALIAS, reason="bootstrapped by zaya run", actor=None
            )
        print(f"model: registered '{BOOTSTRAP_MODEL_NAME}' ({version.id}) as {BOOTSTRAP_MODEL_NAME}@production")
        return BOOTSTRAP_MODEL_NAME
    finally:
        engine.dispose()


def _print_welcome(settings: Settings, host: str, port: int, model: str) -> None:
    cli = f"{sys.executable} -m zaya_cli"
    print(
        f"""
ZAYA is starting on http://{host}:{port}  (data: {settings.data_dir.resolve()}, engine: {settings.engine})

Create an admin key (the secret is printed once, on the last line), in another terminal from this directory:
    {cli} keys create --role admin --name first-admin
Then chat:
    curl http://{host}:{port}/v1/chat/completions -H "Authorization: Bearer $KEY" \\
         -H 'Content-Type: application/json' \\
         -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Summarise case 1."}}], "max_tokens": 60}}'
Press Ctrl-C to stop.
""",
        flush=True,
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=WORKER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _run(args: argparse.Namespace) -> int:
    from server.app import create_app
    from server.db.migrations import upgrade
    from server.http_server import run_server

    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        upgrade(settings.database_url)
    except Exception as error:
        raise CommandError(f"could not migrate {settings.database_url}: {error}") from error
    print(f"database: at the current revision ({settings.database_url})")
    model = ensure_local_model(settings, train_steps=args.bootstrap_train_steps)
    host, port = args.host or settings.host, args.port or settings.port

    worker = subprocess.Popen([sys.executable, "-m", "zaya_cli", "worker"])
    print(f"worker: started (pid {worker.pid})")
    _print_welcome(settings, host, port, model)
    try:
        run_server(create_app(settings), settings, host=host, port=port)
    finally:
        _stop(worker)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = subparsers.add_parser("run", help="run the whole stack: migrate, bootstrap a local model, API + worker")
    run.add_argument("--host", help="bind address (default: ZAYA_HOST or 127.0.0.1)")
    run.add_argument("--port", type=int, help="port (default: ZAYA_PORT or 8000)")
    run.add_argument(
        "--bootstrap-train-steps",
        type=int,
        default=None,
        help="pretraining steps for the bootstrapped tiny model (default: the `bootstrap` preset's 100)",
    )
    run.set_defaults(func=_run)
