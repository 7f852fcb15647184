"""`python -m benchmarks.load_test`: the real server under a mixed load, then under overload.

Starts the whole stack on 127.0.0.1 (`zaya serve` + `zaya worker` processes, SQLite unless `--database-url`, the
local engine, a tiny random model), loads the model and waits until its decode steps are compiled (`/health` 200),
then runs locust headless twice:

1. mixed: analysts streaming chat, data users uploading files and creating / polling fine-tuning jobs, one admin
   promoting versions back and forth, for `--duration` seconds;
2. overload: `--overload-users` clients streaming long chats back to back; the engine's bounded queue must refuse
   the excess with 429 + `Retry-After` (never a 5xx, a timeout or a dropped connection),

then checks the server recovers (a plain chat answers 200 again) and is still healthy. Prints a table per phase
and writes JSON (requests/s, p50/p99 latency of successful requests, time to first token, shed and error counts
per endpoint). Exit status 1 when a request failed, overload shed nothing, or the server did not recover.

Per-key rate limits are switched off for the run (one key per role serves every simulated user), so what sheds
load under overload is the engine's own queue bound (`--engine-queue`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks import environment
from benchmarks.environment import REPO_ROOT
from benchmarks.load_test.report import summarize, table
from benchmarks.load_test.stack import MODEL_NAME, Stack

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
DEFAULT_OUT = environment.default_out("load_test")
RECOVERY_TIMEOUT_S = 60


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load_test", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases with few users (the CI smoke run)")
    parser.add_argument("--duration", type=int, help="seconds of mixed load (default 60, quick 10)")
    parser.add_argument("--users", type=int, help="simulated users in the mixed phase (default 20, quick 6)")
    parser.add_argument("--overload-duration", type=int, help="seconds of overload (default 30, quick 6)")
    parser.add_argument("--overload-users", type=int, help="flooding clients (default 64, quick 24)")
    parser.add_argument("--no-overload", action="store_true", help="skip the overload phase")
    parser.add_argument("--workers", type=int, default=1, help="`zaya worker` processes (default 1)")
    parser.add_argument("--engine-batch", type=int, default=4, help="local engine batch size (default 4)")
    parser.add_argument("--engine-queue", type=int, default=8, help="local engine queue bound (default 8)")
    parser.add_argument("--database-url", default="", help="default: SQLite in the data dir")
    parser.add_argument("--data-dir", type=Path, help="default: a temporary directory, removed afterwards")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON report (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    quick = args.quick
    args.duration = args.duration or (10 if quick else 60)
    args.users = args.users or (6 if quick else 20)
    args.overload_duration = args.overload_duration or (6 if quick else 30)
    args.overload_users = args.overload_users or (24 if quick else 64)
    return args


def run_locust(stack: Stack, classes: list[str], users: int, seconds: int, workdir: Path, name: str) -> dict:
    samples_path = workdir / f"{name}-samples.json"
    env = {
        **os.environ,
        "ZAYA_LOAD_KEYS": json.dumps(stack.keys),
        "ZAYA_LOAD_MODEL": MODEL_NAME,
        "ZAYA_LOAD_MODEL_DIR": str(stack.data_dir / "models" / MODEL_NAME),
        "ZAYA_LOAD_SAMPLES": str(samples_path),
        "ZAYA_LOAD_PHASE": name,  # which refusals are load shedding (see the locustfile)
    }
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", stack.url]
    command += ["-u", str(users), "-r", str(users), "--run-time", f"{seconds}s", "--stop-timeout", "5"]
    command += ["--only-summary", "--loglevel", "WARNING", *classes]
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=seconds + 120)
    elapsed = time.monotonic() - started
    # Locust exits 1 when a request failed (reported below); anything else is locust itself failing.
    if done.returncode not in (0, 1) or not samples_path.exists():
        raise RuntimeError(f"locust failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    samples = json.loads(samples_path.read_text())
    return {"seconds": round(elapsed, 1), "users": users, "endpoints": summarize(samples, elapsed)}


def wait_for_recovery(stack: Stack) -> float | None:
    """Seconds until a plain chat request answers 200 again after the overload; None if it never does."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Still there?"}], "max_tokens": 4}
    started = time.monotonic()
    while time.monotonic() - started < RECOVERY_TIMEOUT_S:
        try:
            response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=stack.headers("analyst"))
            if response.status_code == 200:
                return round(time.monotonic() - started, 2)
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    return None


def warm_engine(stack: Stack) -> None:
    """One request loads the model; `/health` answers 200 once its decode steps are compiled. The phases then
    measure the served model, not the compiler competing with it for the cores."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=stack.headers("analyst"), timeout=300)
    response.raise_for_status()
    stack.wait_until_healthy()


def job_states(stack: Stack) -> dict[str, int]:
    from sqlalchemy import select

    from server.db.models import FineTuningJob

    with stack.database() as sessions, sessions() as session:
        return dict(Counter(session.scalars(select(FineTuningJob.status))))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(args.data_dir or tempfile.mkdtemp(prefix="zaya-load-"))
    engine_env = {
        "ZAYA_LOCAL_ENGINE_MAX_BATCH_SIZE": str(args.engine_batch),
        "ZAYA_LOCAL_ENGINE_MAX_QUEUED_REQUESTS": str(args.engine_queue),
        "ZAYA_RATE_LIMIT_REQUESTS_PER_MINUTE": "0",
        "ZAYA_RATE_LIMIT_TOKENS_PER_MINUTE": "0",
    }
    report: dict = {
        "config": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg()},
        "phases": {},
    }
    stack = Stack(workdir / "stack", database_url=args.database_url, env=engine_env)
    try:
        with stack:
            stack.prepare()
            stack.start_server()
            warm_engine(stack)
            for _ in range(args.workers):
                stack.start_worker()
            mixed = run_locust(
                stack, ["AnalystUser", "DataUser", "AdminUser"], args.users, args.duration, workdir, "mixed"
            )
            report["phases"]["mixed"] = mixed
            print(table(f"mixed load: {args.users} users, {mixed['seconds']} s", mixed["endpoints"]), "\n")
            if not args.no_overload:
                overload = run_locust(
                    stack, ["FloodUser"], args.overload_users, args.overload_duration, workdir, "overload"
                )
                report["phases"]["overload"] = overload
                title = f"overload: {args.overload_users} streaming clients, {overload['seconds']} s"
                print(table(title, overload["endpoints"]), "\n")
            report["recovered_after_s"] = wait_for_recovery(stack)
            assert stack.server is not None
            report["server_alive"] = stack.server.poll() is None
            report["health"] = httpx.get(f"{stack.url}/health").status_code if report["server_alive"] else None
            report["job_states"] = job_states(stack)
    finally:
        if args.data_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    errors = sum(row["errors"] for phase in report["phases"].values() for row in phase["endpoints"].values())
    shed = sum(row["shed"] for row in report["phases"].get("overload", {"endpoints": {}})["endpoints"].values())
    report["machine"]["loadavg_after"] = os.getloadavg()
    report["verdict"] = {
        "errors": errors,
        "overload_shed": shed,
        "recovered": report["recovered_after_s"] is not None and report["health"] == 200,
    }
    ok = errors == 0 and report["verdict"]["recovered"] and (args.no_overload or shed > 0)
    report["verdict"]["ok"] = ok
    environment.write_report(args.out, report)
    print(f"errors {errors}, shed under overload {shed}, recovered after {report['recovered_after_s']} s, ")
    print(f"jobs {report['job_states']}; report: {args.out}; {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
