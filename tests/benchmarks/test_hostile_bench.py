"""Smoke test of `python -m benchmarks.hostile_bench --only pii_line long_line`: a real server answers the hostile
PII lines and the 200 MB single line promptly, with /health answering meanwhile and no memory blow-up."""

import json

import pytest
from benchmark_helpers import output_tail, run_benchmark


@pytest.mark.slow
def test_hostile_lines_are_answered_without_stalling_the_server(tmp_path):
    out = tmp_path / "hostile_bench.json"
    done = run_benchmark("hostile_bench", "--only", "pii_line", "long_line", "--out", str(out), timeout=600)
    assert done.returncode == 0, output_tail(done)
    rows = {row["attack"]: row for row in map(json.loads, done.stdout.splitlines()) if row}
    backtracking = rows["pii_line (200 kB of 'a.')"]
    assert backtracking["answer"] == "200" and backtracking["seconds"] < 10  # 94 s before the patterns were linear
    assert rows["pii_line (200 kB of '1/')"]["answer"] == "200"
    long_line = rows["long_line (200 MB, one line)"]
    assert long_line["answer"] in ("400 line_too_long", "connection closed (RemoteProtocolError)")
    assert long_line["peak_rss_growth_mib"] < 200  # the line is never held whole (1.1 GB before)
    assert max(row["health_worst_s"] for row in rows.values()) < 10
    assert json.loads(out.read_text())["rows"] == list(rows.values())
