"""Private PostgreSQL and Redis servers, for a test run whose configured ones do not answer.

`python tests/private_services.py -- COMMAND ...` runs COMMAND with `ZAYA_TEST_POSTGRES_URL` and `ZAYA_TEST_REDIS_URL`
naming servers that answer: the configured ones when they do, else a PostgreSQL cluster and a Redis server of its own,
in a temporary directory, on free ports of 127.0.0.1, which it stops and deletes when COMMAND ends (`make test` runs
the suites this way). The classes are also what tests use to start a server of their own (to stop and restart it).

The PostgreSQL server programs (`initdb`, `pg_ctl`, `postgres`) come from Debian's `postgresql` package, under
/usr/lib/postgresql/<version>/bin; run as root, the cluster belongs to the `postgres` user that package creates.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

POSTGRES_URL_ENV = "ZAYA_TEST_POSTGRES_URL"
REDIS_URL_ENV = "ZAYA_TEST_REDIS_URL"
DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
START_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def postgres_bin_dir() -> Path | None:
    """The newest installed PostgreSQL server's program directory, or None."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda path: int(path.parts[-3]))
    return found[-1].parent if found else None


def postgres_answers(url: str, timeout_s: float = 3.0) -> bool:
    """Whether a PostgreSQL server answers a query at `url` (an SQLAlchemy URL)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url, connect_args={"connect_timeout": max(1, round(timeout_s))})
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        return True
    except Exception:
        return False
    finally:
        engine.dispose()


def redis_answers(url: str, timeout_s: float = 3.0) -> bool:
    """Whether a Redis server at `url` answers PING (spoken directly: no client library needed)."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class PrivatePostgres:
    """A PostgreSQL cluster in `directory` (which must be reachable by the `postgres` user when run as root), trust
    authentication, listening on 127.0.0.1 only, without fsync: a throwaway server for tests."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        bin_dir = postgres_bin_dir()
        if bin_dir is None:
            raise RuntimeError("no PostgreSQL server under /usr/lib/postgresql (Debian's `postgresql` package)")
        self.bin = bin_dir
        self.directory = Path(directory)
        self.data = self.directory / "data"
        self.port = port or free_port()
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.directory, user="postgres")

    def _run(self, *arguments: str) -> None:
        done = subprocess.run([*self.as_user, *arguments], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(arguments[0]).name} failed ({done.returncode}): {done.stderr or done.stdout}")

    def init(self) -> None:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = str(self.directory / "postgres.log")
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", log, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def create_database(self, name: str) -> None:
        from sqlalchemy import create_engine, text

        engine = create_engine(self.url(), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as connection:
                connection.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            engine.dispose()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    @classmethod
    @contextlib.contextmanager
    def running(cls, database: str = "postgres") -> Iterator[PrivatePostgres]:
        """A new cluster with `database`, stopped and deleted on exit."""
        # Not under pytest's 0700 temporary directories: the postgres user must reach it.
        directory = Path(tempfile.mkdtemp(prefix="zaya-pg-"))
        try:
            server = cls(directory)
            server.init()
            server.start()
            try:
                if database != "postgres":
                    server.create_database(database)
                yield server
            finally:
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    server.stop("immediate")
        finally:
            shutil.rmtree(directory, ignore_errors=True)


class PrivateRedis:
    """A Redis server on 127.0.0.1 that keeps nothing on disk."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = Path(directory)
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        program = shutil.which("redis-server") or "/usr/bin/redis-server"
        arguments = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        with open(self.directory / "redis.log", "ab") as log:  # the server keeps its own descriptor
            self.process = subprocess.Popen([program, *arguments, "--dir", str(self.directory)], stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not redis_answers(self.url(), timeout_s=1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {(self.directory / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def url(self, database: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{database}"

    @classmethod
    @contextlib.contextmanager
    def running(cls) -> Iterator[PrivateRedis]:
        directory = Path(tempfile.mkdtemp(prefix="zaya-redis-"))
        server = cls(directory)
        try:
            server.start()
            yield server
        finally:
            server.stop()
            shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def answering_services(environ: dict[str, str], log=print) -> Iterator[dict[str, str]]:
    """`environ` with both URLs naming servers that answer: the configured ones, else private ones for the block."""
    postgres_url = environ.get(POSTGRES_URL_ENV) or DEFAULT_POSTGRES_URL
    redis_url = environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL
    with contextlib.ExitStack() as servers:
        if not postgres_answers(postgres_url):
            database = urlsplit(postgres_url).path.lstrip("/") or "postgres"
            postgres = servers.enter_context(PrivatePostgres.running(database))
            log(
                f"{POSTGRES_URL_ENV}: {postgres_url} does not answer; a private PostgreSQL serves this run at port "
                f"{postgres.port} ({postgres.directory})"
            )
            postgres_url = postgres.url(database)
        if not redis_answers(redis_url):
            redis = servers.enter_context(PrivateRedis.running())
            log(f"{REDIS_URL_ENV}: {redis_url} does not answer; a private Redis serves this run at port {redis.port}")
            redis_url = redis.url()
        yield {**environ, POSTGRES_URL_ENV: postgres_url, REDIS_URL_ENV: redis_url}


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print(f"usage: {Path(__file__).name} -- COMMAND [ARGUMENTS...]", file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1 :]

    def stop(signum, _frame):  # leave through the context managers, which stop and delete the servers
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    with answering_services(dict(os.environ), log=lambda line: print(line, flush=True)) as environ:
        child = subprocess.Popen(command, env=environ)
        try:
            return child.wait()
        except BaseException:
            child.terminate()
            child.wait()
            raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
