"""Smoke test of `python -m benchmarks.load_test --quick`: the real stack under mixed load, then overloaded.

Checks the harness runs end to end and what the overload phase is for: the server sheds the excess with 429 +
Retry-After (never a 5xx, a timeout or a dropped connection), stays up and answers again right after. Under mixed load
nothing is refused but with 429: a 503 there is an error. On SQLite, or on the PostgreSQL pass's server.
"""

import json

import pytest
from benchmark_helpers import output_tail, run_benchmark

from benchmarks.load_test.shedding import refusal_problem


@pytest.mark.slow
def test_quick_load_test_sheds_overload_with_429_and_recovers(tmp_path, fresh_database):
    out = tmp_path / "load.json"
    with fresh_database(tmp_path) as database_url:
        arguments = ["--quick", "--out", str(out), "--data-dir", str(tmp_path / "run"), "--database-url", database_url]
        # ~45 s on an idle 2-core machine; minutes when the machine is shared
        done = run_benchmark("load_test", *arguments, timeout=600)
    assert done.returncode == 0, output_tail(done)
    report = json.loads(out.read_text())

    mixed = report["phases"]["mixed"]["endpoints"]
    for endpoint in ("chat stream", "chat", "file upload"):
        assert mixed[endpoint]["ok"] > 0, (endpoint, mixed)
    flood = report["phases"]["overload"]["endpoints"]["chat stream (flood)"]
    assert flood["shed"] > 0 and flood["ok"] > 0, flood
    assert set(flood["statuses"]) <= {"200", "429", "503"}, flood
    for phase in report["phases"].values():
        for endpoint, row in phase["endpoints"].items():
            assert row["errors"] == 0, (endpoint, row["failures"])
    assert report["verdict"]["recovered"] and report["server_alive"], report
    assert "mixed load" in done.stdout and "overload" in done.stdout


def test_a_503_is_load_shedding_only_in_the_overload_phase():
    assert refusal_problem(503, "1", True, "overload") is None
    assert refusal_problem(503, "1", True, "mixed") == "HTTP 503 outside the overload phase"
    assert refusal_problem(429, "1", True, "mixed") is None
    assert refusal_problem(429, None, True, "mixed") == "429 without Retry-After or OpenAI error body"
    assert refusal_problem(503, "1", False, "overload") == "503 without Retry-After or OpenAI error body"
    assert refusal_problem(500, "1", True, "overload") == "HTTP 500"
