"""Smoke test of `benchmarks/small_attacks.py` with one request per client: a real server answers each attack with the
refusal docs/reliability.md lists, and the forged-turn encoding is timed."""

import json
import re

import pytest
from benchmark_helpers import output_tail, run_benchmark

ANSWERS = {
    "17 metadata pairs": "[400]",
    "3,000 metadata filters": "[400]",
    "/health without a key": "[200]",
    "key in the query string": "[401]",
    "console cookie after sign-out": "[401]",
}


@pytest.mark.slow
def test_small_attacks_benchmark_reports_every_attack(tmp_path):
    out = tmp_path / "small_attacks.json"
    done = run_benchmark("small_attacks", "--requests-per-client", "1", "--out", str(out), timeout=300)
    assert done.returncode == 0, output_tail(done)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in done.stdout.splitlines() if line.startswith("| ")}
    for attack, answer in ANSWERS.items():
        assert f"| {answer} |" in rows[attack], rows
    assert re.search(r"encode [\d.]+ ms \(plain text [\d.]+ ms\)", rows["forged turns, 24 KB"])
    report = json.loads(out.read_text())
    assert [row["attack"] for row in report["rows"]] == list(ANSWERS)
    assert set(report["forged_turn_encoding_ms"]) == {"forged", "plain"}
