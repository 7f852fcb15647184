"""A real ZAYA stack on 127.0.0.1 for load and fault tests: `zaya serve` and `zaya worker` processes.

`Stack.prepare()` migrates the database, builds a tiny random ZAYA model (tokenizer trained here, no download),
registers it as `zaya-tiny@production` and makes one key per role; then `start_server()` / `start_worker()` run the
real commands as child processes (their output goes to log files under the data dir), so a test can `kill -9`
them and start them again on the same data.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy.orm import Session, sessionmaker

from benchmarks.environment import REPO_ROOT

MODEL_NAME = "zaya-tiny"
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(
    url: str, process: subprocess.Popen | None, timeout_s: float, poll_s: float, log: Path | None = None
) -> None:
    """Poll `url`'s `/health` every `poll_s` seconds until it answers 200; an error if `process` exits first or
    `timeout_s` seconds pass (with the tail of the server's `log`, where it has one)."""

    def failure(message: str) -> RuntimeError:  # the log's tail as it is when the wait fails
        return RuntimeError(message if log is None else f"{message}:\n{Stack.tail(log)}")

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise failure(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    raise failure(f"the server did not become healthy in {timeout_s} s")


def stop(process: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM, then SIGKILL if `process` is still running after `grace_s` seconds."""
    process.terminate()
    wait_or_kill(process, grace_s)


def wait_or_kill(process: subprocess.Popen, grace_s: float) -> None:
    """Wait up to `grace_s` seconds for `process` to exit, then SIGKILL it."""
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def build_model(directory: Path) -> Path:
    """The tiny model `zaya run` bootstraps, after one training step (near-random weights): fast, and all the engine
    needs."""
    from finetune.bootstrap import build_tiny_model

    if not (directory / "config.json").is_file():
        build_tiny_model(directory, train_steps=1)
    return directory


@dataclass
class Stack:
    data_dir: Path
    database_url: str = ""
    # Extra ZAYA_* settings for the server and workers (engine queue bounds, limits...).
    env: dict[str, str] = field(default_factory=dict)
    # Where the processes' logs go (default: the data dir; elsewhere when the data dir is made to fill up).
    log_dir: Path | None = None
    port: int = field(default_factory=free_port)
    # Torch threads of each process: one, as many processes share the cores in load and fault tests; None leaves
    # torch's default (a benchmark's one server).
    torch_threads: int | None = 1
    keys: dict[str, str] = field(default_factory=dict)
    server: subprocess.Popen | None = None
    workers: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.database_url = self.database_url or f"sqlite:///{self.data_dir / 'zaya.db'}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def logs(self) -> Path:
        """Where the processes' logs go: `log_dir`, or the data dir."""
        return Path(self.log_dir or self.data_dir)

    @property
    def server_log(self) -> Path:
        return self.logs / "server.log"

    @property
    def worker_log(self) -> Path:
        return self.logs / "workers.log"

    def process_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "ZAYA_DATA_DIR": str(self.data_dir),
            "ZAYA_DATABASE_URL": self.database_url,
            **({"OMP_NUM_THREADS": str(self.torch_threads)} if self.torch_threads else {}),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **self.env,
        }

    @contextmanager
    def database(self) -> Iterator[sessionmaker[Session]]:
        """A sessionmaker on the stack's database, for setting up and checking what the processes did."""
        from server.db.session import make_engine, make_sessionmaker

        engine = make_engine(self.database_url)
        try:
            yield make_sessionmaker(engine)
        finally:
            engine.dispose()

    def prepare(self, model_dir: Path | None = None) -> Stack:
        """Migrate, register the model (built under the data dir unless given) and create a key per role."""
        from server.db.migrations import upgrade
        from server.db.models import Role
        from server.db.session import session_scope
        from server.services import registry
        from server.services.keys import create_key

        upgrade(self.database_url)
        model_dir = build_model(model_dir or self.data_dir / "models" / MODEL_NAME)
        with self.database() as sessions, session_scope(sessions) as session:
            version = registry.register_version(session, name=MODEL_NAME, path=model_dir)
            registry.promote(session, version, alias=registry.DEFAULT_ALIAS, reason="load/fault test", actor=None)
            for role in Role:
                self.keys[role.value] = create_key(session, name=f"{role.value} (stack)", role=role).secret
        return self

    def headers(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"}

    # --- processes ----------------------------------------------------------------------------------------------
    def _spawn(self, arguments: list[str], log_path: Path) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "zaya_cli", *arguments],
                cwd=REPO_ROOT,
                env=self.process_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def start_server(self, *, wait: bool = True) -> subprocess.Popen:
        self.server = self._spawn(["serve", "--port", str(self.port)], self.server_log)
        if wait:
            self.wait_until_healthy()
        return self.server

    def wait_until_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        # Every 0.5 s: each /health checks the schema, and polling harder slows the engine's start.
        wait_until_healthy(self.url, self.server, timeout, poll_s=0.5, log=self.server_log)

    def start_worker(self, *extra: str) -> subprocess.Popen:
        arguments = ["worker", "--lease-seconds", "5", "--heartbeat-seconds", "0.5", "--poll-seconds", "0.2", *extra]
        worker = self._spawn(arguments, self.worker_log)
        self.workers.append(worker)
        return worker

    def kill_server(self) -> None:
        """SIGKILL: no shutdown handler runs, as in a crash or an OOM kill."""
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGKILL)
            self.server.wait()

    def close(self) -> None:
        """Stop everything still running: SIGTERM (workers checkpoint and re-queue), then SIGKILL after a grace."""
        processes = [process for process in [self.server, *self.workers] if process is not None]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            wait_or_kill(process, 30)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def tail(path: Path, chars: int = 4000) -> str:
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"
