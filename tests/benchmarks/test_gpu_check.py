"""Smoke test of `python -m benchmarks.gpu_check --quick` on CPU: the checks against the CPU reference pass and every
row of the report is measured (the compiled rows say why not: compiling is off on a CPU by default)."""

import json
import math
import time

from benchmark_helpers import output_tail, run_benchmark


def test_quick_run_checks_and_measures_every_row(tmp_path):
    out = tmp_path / "gpu_check.json"
    start = time.monotonic()
    arguments = ["--quick", "--device", "cpu", "--threads", "1", "--out", str(out)]
    done = run_benchmark("gpu_check", *arguments, timeout=540)  # ~1 min on an idle 2-core machine
    print(f"--quick took {time.monotonic() - start:.1f} s")
    assert done.returncode == 0, output_tail(done)
    report = json.loads(out.read_text())

    checks = report["checks"]
    assert checks["passed"]
    assert all(r["relative_error"] <= 1e-4 for r in checks["fp32_logits"].values())
    assert checks["bf16_greedy"]["consistent_tokens"] == checks["bf16_greedy"]["tokens"] > 0

    phases = {(row["shape"], row["phase"], row["precision"]) for row in report["rows"]}
    assert len(phases) == len(report["rows"]) == 9  # 2 shapes x (train, prefill, 2 decodes) + wide train bf16
    for row in report["rows"]:
        for impl in ("ours_eager", "ours_best", "upstream_eager"):
            result = row["impls"][impl]
            assert len(result["tokens_per_s"]) == report["sizes"]["repeats"], (row["phase"], impl)
            assert all(math.isfinite(v) and v > 0 for v in result["tokens_per_s"])
        assert "not_measured" in row["impls"]["upstream_compiled"]
        assert math.isclose(
            row["eager_over_eager"],
            row["impls"]["ours_eager"]["median_tokens_per_s"] / row["impls"]["upstream_eager"]["median_tokens_per_s"],
        )
        assert row["best_over_best"] > 0
        if row["phase"] == "train":
            assert row["same_training"]["passed"]
            assert row["impls"]["ours_best"]["mfu"] > 0
        if row["phase"] == "prefill":
            assert row["same_outputs"]["passed"]
    assert report["targets"]["wide_train_best_over_best"]["value"] > 0
    assert "| zaya1-base-wide" not in done.stdout and "| wide-tiny | train | autocast |" in done.stdout
