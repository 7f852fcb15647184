"""`tests/private_services.py`, the path `make test` takes on a machine whose PostgreSQL and Redis do not answer: the
configured URLs point at unused ports, so a private cluster and server start for the command and are gone after."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from private_services import POSTGRES_URL_ENV, REDIS_URL_ENV, free_port, postgres_answers, redis_answers

WRAPPER = Path(__file__).with_name("private_services.py")
# Run by the wrapper: uses both servers, then runs the wrapper again, which must keep URLs that answer as they are.
PROBE = f"""
import json, os, subprocess, sys
from sqlalchemy import create_engine, text
sys.path.insert(0, {str(WRAPPER.parent)!r})
from private_services import redis_answers
postgres, redis = os.environ[{POSTGRES_URL_ENV!r}], os.environ[{REDIS_URL_ENV!r}]
engine = create_engine(postgres)
with engine.begin() as connection:
    connection.execute(text("CREATE TABLE probe (id integer)"))
    database = connection.execute(text("SELECT current_database()")).scalar()
    directory = connection.execute(text("SHOW data_directory")).scalar()
engine.dispose()
show = "import os; print(os.environ[{POSTGRES_URL_ENV!r}]); print(os.environ[{REDIS_URL_ENV!r}])"
nested = subprocess.run([sys.executable, {str(WRAPPER)!r}, "--", sys.executable, "-c", show],
                        capture_output=True, text=True, check=True).stdout.splitlines()
print(json.dumps({{"postgres": postgres, "redis": redis, "database": database, "directory": directory,
                  "redis_answers": redis_answers(redis), "nested": nested}}))
sys.exit(3)
"""


def refuses(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_unanswered_urls_get_private_servers_for_the_command_which_are_removed_after_it():
    given_postgres = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/zaya_ci"
    given_redis = f"redis://127.0.0.1:{free_port()}/0"
    environ = {**os.environ, POSTGRES_URL_ENV: given_postgres, REDIS_URL_ENV: given_redis}
    command = [sys.executable, str(WRAPPER), "--", sys.executable, "-c", PROBE]
    done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=300)

    assert done.returncode == 3, done.stdout + done.stderr  # the command's own exit status
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert f"{POSTGRES_URL_ENV}: {given_postgres} does not answer" in done.stdout
    assert f"{REDIS_URL_ENV}: {given_redis} does not answer" in done.stdout
    assert seen["postgres"] != given_postgres and seen["database"] == "zaya_ci"  # the URL's database, created
    assert seen["redis"] != given_redis and seen["redis_answers"]
    assert seen["nested"] == [seen["postgres"], seen["redis"]]  # servers that answer are used as they are
    # Afterwards: both servers stopped, the cluster's directory deleted.
    assert refuses(urlsplit(seen["postgres"]).port) and refuses(urlsplit(seen["redis"]).port)
    assert not postgres_answers(seen["postgres"], timeout_s=1) and not redis_answers(seen["redis"], timeout_s=1)
    assert not Path(seen["directory"]).parent.exists()
