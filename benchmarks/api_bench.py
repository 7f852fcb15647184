"""Throughput of the API server and the job queue: authenticated `GET /v1/models`, the cost of authentication
itself, job creation, and jobs claimed per second by 1 and 4 worker processes.

Run: `python -m benchmarks.api_bench [--quick] [--database-url URL] [--out benchmarks/results/api_bench.json]`

The server runs as a real `uvicorn` process on 127.0.0.1 (a fresh data dir, the database migrated first); clients
are threads with keep-alive connections. With a PostgreSQL URL (`--database-url`, else `ZAYA_BENCH_DATABASE_URL`)
everything happens in a fresh schema that is dropped at the end; without one, in a temporary SQLite file. The
claim targets are PostgreSQL's (SQLite runs writes one at a time). Rate limits are switched off for the server.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from sqlalchemy import text
from sqlalchemy.engine import make_url

from benchmarks import environment
from benchmarks.environment import REPO_ROOT, timed_stage
from benchmarks.load_test.stack import free_port, stop, wait_until_healthy
from server.db.migrations import upgrade
from server.db.models import DEFAULT_PROJECT_ID, File, FineTuningJob, JobStatus, Role, new_id
from server.db.scratch import scratch_database
from server.db.session import make_autocommit_sessionmaker, make_engine, make_sessionmaker, session_scope
from server.services import jobs, keys, registry
from server.services.access import Scope

DEFAULT_OUT = environment.default_out("api_bench")
DATABASE_URL_ENV = "ZAYA_BENCH_DATABASE_URL"
AUTH_TARGET_MS = 1.0  # issue 5: authentication adds at most 1 ms per request
CLAIMS_TARGET_PER_S = 200.0  # issue 5: at least 200 claims/s with 4 workers on PostgreSQL
CLAIM_WORKERS = (1, 4)
SERVER_START_TIMEOUT_S = 300
DATASET = b"".join(
    b'{"messages": [{"role": "user", "content": "Balance of account %d?"}, '
    b'{"role": "assistant", "content": "It is %d EUR."}]}\n' % (i, 100 + i)
    for i in range(5)
)


@dataclass(frozen=True)
class BenchSizes:
    """Everything `--quick` shrinks."""

    list_requests: int
    clients: int
    auth_calls: int
    job_creations: int
    claims_per_run: int


FULL = BenchSizes(list_requests=3000, clients=4, auth_calls=3000, job_creations=300, claims_per_run=2000)
QUICK = BenchSizes(list_requests=100, clients=2, auth_calls=100, job_creations=10, claims_per_run=60)


# --- the database ---------------------------------------------------------------------------------------------------


@contextmanager
def bench_database(server_url: str | None, directory: Path) -> Iterator[str]:
    """A migrated, empty database: a scratch schema in PostgreSQL (dropped afterwards), else a new SQLite file."""
    with scratch_database(directory, server_url) as url:
        upgrade(url)
        yield url


def seed(database_url: str, model_dir: Path) -> dict:
    """An admin key, a data key and a registered base model (a checkpoint dir job creation accepts)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text('{"model_type": "zaya"}')
    engine = make_engine(database_url)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            admin = keys.create_key(session, name="bench admin", role=Role.admin)
            data = keys.create_key(session, name="bench data", role=Role.data)
            base = registry.register_version(session, name="bench-base", path=model_dir)
            return {"admin": admin.secret, "data": data.secret, "model": base.name}
    finally:
        engine.dispose()


# --- the server -----------------------------------------------------------------------------------------------------


@contextmanager
def api_server(database_url: str, data_dir: Path) -> Iterator[str]:
    """`uvicorn` serving the app in its own process; yields the base URL."""
    port = free_port()
    env = {
        **os.environ,
        "ZAYA_DATABASE_URL": database_url,
        "ZAYA_DATA_DIR": str(data_dir),
        "ZAYA_RATE_LIMIT_REQUESTS_PER_MINUTE": "0",
        "ZAYA_RATE_LIMIT_TOKENS_PER_MINUTE": "0",
        "HF_HUB_OFFLINE": "1",
    }
    command = [sys.executable, "-m", "uvicorn", "--factory", "server.app:create_app"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        # Ready: the database answers and the inference engine has started (its imports would otherwise compete
        # with the measurements for the CPU).
        wait_until_healthy(base_url, process, SERVER_START_TIMEOUT_S, poll_s=0.2)
        yield base_url
    finally:
        stop(process, grace_s=30)


# --- measurements ---------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(latencies_s: list[float], seconds: float) -> dict:
    milliseconds = [value * 1000 for value in latencies_s]
    return {
        "requests": len(latencies_s),
        "seconds": round(seconds, 4),
        "requests_per_s": round(len(latencies_s) / seconds, 1),
        "latency_ms": {
            "p50": round(percentile(milliseconds, 0.5), 3),
            "p99": round(percentile(milliseconds, 0.99), 3),
        },
    }


def load(base_url: str, secret: str, total: int, clients: int, send: Callable[[httpx.Client, int], None]) -> dict:
    """`total` calls of `send(client, i)` spread over `clients` threads, each with its own keep-alive connection."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    start_line = threading.Barrier(clients + 1)

    def run(index: int) -> None:
        headers = {"Authorization": f"Bearer {secret}"}
        with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
            send(client, -1 - index)  # opens the connection outside the timing
            start_line.wait()
            for i in range(index, total, clients):
                started = time.perf_counter()
                send(client, i)
                latencies[index].append(time.perf_counter() - started)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(clients)]
    for thread in threads:
        thread.start()
    start_line.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return summary([value for per_client in latencies for value in per_client], time.perf_counter() - started)


def expect(response: httpx.Response, status: int = 200) -> None:
    if response.status_code != status:
        raise RuntimeError(f"{response.request.method} {response.request.url}: {response.status_code} {response.text}")


def bench_list_models(base_url: str, secret: str, sizes: BenchSizes) -> dict:
    return load(base_url, secret, sizes.list_requests, sizes.clients, lambda c, _: expect(c.get("/v1/models")))


def bench_job_creation(base_url: str, secrets_: dict, sizes: BenchSizes) -> dict:
    headers = {"Authorization": f"Bearer {secrets_['data']}"}
    upload = httpx.post(
        f"{base_url}/v1/files",
        headers=headers,
        data={"purpose": "fine-tune"},
        files={"file": ("bench.jsonl", DATASET)},
        timeout=120,
    )
    expect(upload)
    body = {"model": secrets_["model"], "training_file": upload.json()["id"]}
    # The first creation imports the fine-tuning core in the server (seconds): keep it out of the timing.
    expect(httpx.post(f"{base_url}/v1/fine_tuning/jobs", headers=headers, json=body, timeout=300))
    return load(
        base_url,
        secrets_["data"],
        sizes.job_creations,
        sizes.clients,
        lambda c, _: expect(c.post("/v1/fine_tuning/jobs", json=body)),
    )


def bench_authentication(database_url: str, secret: str, calls: int) -> dict:
    """What the request middleware does per request, timed alone: a session, the key looked up by its prefix, the
    secret's hash compared, revocation checked (`last_used_at` is written at most once a minute, as served)."""
    engine = make_engine(database_url, pre_ping=False)
    sessions = make_autocommit_sessionmaker(engine)  # as the middleware authenticates
    resolution = datetime.timedelta(seconds=60)
    try:
        for _ in range(min(calls, 20)):  # warm the pool and the statement cache
            with sessions() as session:
                assert keys.authenticate(session, secret, last_used_resolution=resolution) is not None
        durations = []
        for _ in range(calls):
            started = time.perf_counter()
            with sessions() as session:
                key = keys.authenticate(session, secret, last_used_resolution=resolution)
            durations.append(time.perf_counter() - started)
            assert key is not None
    finally:
        engine.dispose()
    milliseconds = [value * 1000 for value in durations]
    return {
        "calls": calls,
        "ms_median": round(statistics.median(milliseconds), 4),
        "ms_p99": round(percentile(milliseconds, 0.99), 4),
        "target_ms": AUTH_TARGET_MS,
    }


def enqueue(database_url: str, n: int) -> list[str]:
    """`n` queued jobs straight into the table (the queue does not care how they got there)."""
    engine = make_engine(database_url)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            base = registry.list_versions(session, Scope.everything(), name="bench-base")[0]
            dataset = File(
                filename="bench.jsonl",
                purpose="fine-tune",
                bytes=len(DATASET),
                sha256="0" * 64,
                project_id=DEFAULT_PROJECT_ID,
            )
            session.add(dataset)
            session.flush()
            created = [
                FineTuningJob(
                    id=new_id("ftjob-"),
                    model=base.name,
                    base_version_id=base.id,
                    training_file_id=dataset.id,
                    status=JobStatus.queued,
                    project_id=DEFAULT_PROJECT_ID,
                )
                for _ in range(n)
            ]
            session.add_all(created)
            return [job.id for job in created]
    finally:
        engine.dispose()


def claim_worker(database_url: str, worker_id: str, start_line, results) -> None:
    """One worker process: claim until the queue is empty (the claim is the whole job: a no-op runner)."""
    engine = make_engine(database_url)
    sessions = make_sessionmaker(engine)
    with sessions() as session:  # connect before the start line
        session.execute(text("SELECT 1"))
    claimed = []
    start_line.wait()
    started = time.monotonic()
    while True:
        with sessions() as session:
            lease = jobs.claim_next_job(session, worker_id=worker_id, lease_seconds=3600)
        if lease is None:
            break
        claimed.append(lease.job_id)
    results.put({"worker": worker_id, "started": started, "ended": time.monotonic(), "claimed": claimed})
    engine.dispose()


def bench_claims(database_url: str, workers: int, n_jobs: int) -> dict:
    job_ids = set(enqueue(database_url, n_jobs))
    context = multiprocessing.get_context("spawn")
    start_line = context.Barrier(workers)
    results = context.Queue()
    processes = [
        context.Process(target=claim_worker, args=(database_url, f"bench-{workers}-{index}", start_line, results))
        for index in range(workers)
    ]
    for process in processes:
        process.start()
    reports = [results.get(timeout=600) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    claimed = [job_id for report in reports for job_id in report["claimed"]]
    seconds = max(r["ended"] for r in reports) - min(r["started"] for r in reports)
    return {
        "workers": workers,
        "jobs": n_jobs,
        "claimed": len(claimed),
        "claimed_twice": len(claimed) - len(set(claimed)),
        "missed": len(job_ids - set(claimed)),
        "per_worker": [len(report["claimed"]) for report in reports],
        "seconds": round(seconds, 4),
        "claims_per_s": round(len(claimed) / seconds, 1),
    }


# --- the report -----------------------------------------------------------------------------------------------------


def run_benchmark(sizes: BenchSizes, mode: str, server_url: str | None) -> dict:
    backend = make_url(server_url).get_backend_name() if server_url else "sqlite"
    report: dict = {
        "benchmark": "api_bench",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": mode,
        "database": backend,
        "machine": environment.machine_summary(),
        "sizes": asdict(sizes),
    }
    stages = report["stage_seconds"] = {}
    with tempfile.TemporaryDirectory(prefix="zaya-api-bench-") as tmp, bench_database(server_url, Path(tmp)) as url:
        secrets_ = seed(url, Path(tmp) / "model")
        print("server start ...", flush=True)
        started = time.perf_counter()
        with api_server(url, Path(tmp) / "data") as base_url:
            stages["server start"] = round(time.perf_counter() - started, 2)
            with timed_stage(stages, "GET /v1/models"):
                report["list_models"] = bench_list_models(base_url, secrets_["admin"], sizes)
            with timed_stage(stages, "POST /v1/fine_tuning/jobs"):
                report["job_creation"] = bench_job_creation(base_url, secrets_, sizes)
        with timed_stage(stages, "authentication"):
            report["authentication"] = bench_authentication(url, secrets_["admin"], sizes.auth_calls)
        report["claims"] = {}
        for workers in CLAIM_WORKERS:
            with timed_stage(stages, f"claims, {workers} worker process(es)"):
                report["claims"][str(workers)] = bench_claims(url, workers, sizes.claims_per_run)
    claims_4 = report["claims"][str(max(CLAIM_WORKERS))]["claims_per_s"]
    report["targets"] = {
        "auth_ms": {
            "value": report["authentication"]["ms_median"],
            "max": AUTH_TARGET_MS,
            "met": report["authentication"]["ms_median"] <= AUTH_TARGET_MS,
        },
        "claims_per_s_4_workers": {
            "value": claims_4,
            "min": CLAIMS_TARGET_PER_S,
            # The target is PostgreSQL's; on SQLite there is nothing to meet.
            "met": claims_4 >= CLAIMS_TARGET_PER_S if backend == "postgresql" else None,
        },
    }
    return report


def print_table(report: dict) -> None:
    def met(target: dict) -> str:
        return {True: "met", False: "NOT met", None: "n/a (PostgreSQL target)"}[target["met"]]

    rows = [
        ("metric", "value", "target"),
        ("GET /v1/models (authenticated), requests/s", f"{report['list_models']['requests_per_s']:,.0f}", ""),
        ("GET /v1/models latency p50 / p99, ms", _latency(report["list_models"]), ""),
        (
            "authentication per request, ms (median / p99)",
            f"{report['authentication']['ms_median']:.3f} / {report['authentication']['ms_p99']:.3f}",
            f"<= {AUTH_TARGET_MS} ms: {met(report['targets']['auth_ms'])}",
        ),
        ("POST /v1/fine_tuning/jobs, requests/s", f"{report['job_creation']['requests_per_s']:,.0f}", ""),
        ("POST /v1/fine_tuning/jobs latency p50 / p99, ms", _latency(report["job_creation"]), ""),
    ]
    for workers, claims in report["claims"].items():
        target = ""
        if workers == str(max(CLAIM_WORKERS)):
            target = f">= {CLAIMS_TARGET_PER_S:.0f}/s: {met(report['targets']['claims_per_s_4_workers'])}"
        rows.append((f"jobs claimed/s, {workers} worker process(es)", f"{claims['claims_per_s']:,.0f}", target))
    print(f"\napi_bench ({report['mode']}, {report['database']}, {report['list_models']['requests']} list requests)")
    print(environment.format_rows(rows, separator=" | "))


def _latency(section: dict) -> str:
    return f"{section['latency_ms']['p50']:.2f} / {section['latency_ms']['p99']:.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few requests and jobs (a smoke test, seconds)")
    parser.add_argument(
        "--database-url",
        default=os.environ.get(DATABASE_URL_ENV),
        help=f"PostgreSQL server to run in (a fresh schema, dropped afterwards); default ${DATABASE_URL_ENV}, "
        "else a temporary SQLite file",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON report path (default {DEFAULT_OUT})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = "quick" if args.quick else "full"
    report = run_benchmark(QUICK if args.quick else FULL, mode, args.database_url)
    environment.publish_report(args.out, report, print_table)
    failures = [c for c in report["claims"].values() if c["claimed_twice"] or c["missed"]]
    if failures:
        print(f"ERROR: jobs claimed twice or missed: {json.dumps(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
