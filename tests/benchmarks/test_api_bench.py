"""Smoke test of `python -m benchmarks.api_bench --quick`: a real server, real claims by worker processes, and a JSON
report with every metric. On SQLite, or on the PostgreSQL pass's server (in a scratch schema the benchmark makes)."""

import json
import math

import pytest
from benchmark_helpers import output_tail, run_benchmark


def _positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def _throughput(section: dict, requests: int) -> None:
    assert section["requests"] == requests
    assert _positive(section["requests_per_s"]) and _positive(section["seconds"])
    assert 0 < section["latency_ms"]["p50"] <= section["latency_ms"]["p99"]


@pytest.mark.slow
def test_quick_api_benchmark_reports_every_metric(tmp_path, database_server_url):
    out = tmp_path / "results" / "api_bench.json"
    arguments = ["--quick", "--out", str(out)]
    database_url = database_server_url
    if database_url:
        arguments += ["--database-url", database_url]
    done = run_benchmark("api_bench", *arguments, timeout=500)
    assert done.returncode == 0, output_tail(done)
    report = json.loads(out.read_text())

    assert (report["benchmark"], report["mode"]) == ("api_bench", "quick")
    assert report["database"] == ("postgresql" if database_url else "sqlite")
    sizes = report["sizes"]
    _throughput(report["list_models"], sizes["list_requests"])
    _throughput(report["job_creation"], sizes["job_creations"])
    auth = report["authentication"]
    assert auth["calls"] == sizes["auth_calls"] and 0 < auth["ms_median"] <= auth["ms_p99"]

    assert set(report["claims"]) == {"1", "4"}
    for workers, claims in report["claims"].items():
        assert claims["workers"] == int(workers) and len(claims["per_worker"]) == int(workers)
        assert claims["claimed"] == claims["jobs"] == sizes["claims_per_run"] == sum(claims["per_worker"])
        assert claims["claimed_twice"] == 0 and claims["missed"] == 0
        assert _positive(claims["claims_per_s"])

    targets = report["targets"]
    assert targets["auth_ms"]["met"] == (auth["ms_median"] <= targets["auth_ms"]["max"])
    claims_target = targets["claims_per_s_4_workers"]
    assert claims_target["value"] == report["claims"]["4"]["claims_per_s"]
    if database_url:
        assert claims_target["met"] == (claims_target["value"] >= claims_target["min"])
    else:
        assert claims_target["met"] is None  # the claim target is PostgreSQL's
    assert "jobs claimed/s, 4 worker process(es)" in done.stdout
