"""Smoke test of `python -m benchmarks.finetune_bench --quick`: it runs end to end and its JSON report holds every
metric."""

import json
import math

import pytest
from benchmark_helpers import output_tail, run_benchmark

# --quick leaves out upstream compiled (compiling upstream on CPU takes minutes) and says so.
VARIANTS = (
    "ours_full",
    "ours_lora",
    "ours_lora+gc",
    "ours_full+compile",
    "ours_lora+compile",
    "upstream_full",
    "upstream_lora",
    "ours_full+skip_logits",
    "ours_lora+skip_logits",
)


def _positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_quick_finetune_benchmark_reports_every_metric(tmp_path):
    out = tmp_path / "results" / "finetune_bench.json"
    # ~1.5 min on an idle 2-core machine; under pytest-timeout's 600 s
    done = run_benchmark("finetune_bench", "--quick", "--threads", "1", "--out", str(out), timeout=540)
    assert done.returncode == 0, output_tail(done)
    report = json.loads(out.read_text())

    assert report["mode"] == "quick"
    assert report["max_abs_loss_diff_before_training"] <= 1e-4
    assert report["batch"]["trained_tokens"] > 0
    trainable = report["parameters"]["trainable"]
    assert trainable["ours_full"] == trainable["upstream_full"] == report["parameters"]["total"]
    assert trainable["ours_lora"] == trainable["ours_lora+gc"] == trainable["ours_lora+compile"]
    assert trainable["ours_lora"] == trainable["ours_lora+skip_logits"]
    assert set(report["medians"]) == set(VARIANTS)
    assert set(report["not_measured"]) == {"upstream_full+compile", "upstream_lora+compile"}
    # Every variant's first step, compiled and skip_logits ones included, computed the same loss.
    assert set(report["first_step_loss"]) == set(VARIANTS)
    assert trainable["ours_lora"] == trainable["upstream_lora"]
    assert 0 < trainable["ours_lora"] < trainable["ours_full"]
    for variant in VARIANTS:
        assert len(report["seconds"][variant]) == report["sizes"]["repeats"]
        assert all(_positive(s) for s in report["tokens_per_s"][variant])
        assert _positive(report["medians"][variant]["step_s"]) and _positive(report["medians"][variant]["tokens_per_s"])
        memory = report["peak_memory"][variant]
        assert "error" not in memory, (variant, memory)
        assert memory["peak_delta_mib"] >= 0 and memory["peak_rss_mib"] >= memory["baseline_mib"] > 0
    medians = report["medians"]
    expected = medians["ours_lora"]["tokens_per_s"] / medians["upstream_lora"]["tokens_per_s"]
    assert math.isclose(report["ratios"]["ours/upstream tokens/s, lora, eager/eager"], expected)
    best = max(medians["ours_full"]["tokens_per_s"], medians["ours_full+compile"]["tokens_per_s"])
    expected = best / medians["upstream_full"]["tokens_per_s"]
    assert math.isclose(report["ratios"]["ours/upstream tokens/s, full, best/best"], expected)
    assert report["best"]["full"]["upstream"] == "upstream_full"
    expected = medians["ours_full+skip_logits"]["tokens_per_s"] / medians["upstream_full"]["tokens_per_s"]
    assert math.isclose(report["ratios"]["ours with skip_logits/upstream tokens/s, full, eager/eager"], expected)
    expected = medians["ours_lora"]["step_s"] / medians["ours_full"]["step_s"]
    assert math.isclose(report["ratios"]["lora/full step time (ours)"], expected)
    memory = report["peak_memory"]
    expected = memory["ours_lora+gc"]["peak_rss_mib"] / memory["ours_full"]["peak_rss_mib"]
    assert math.isclose(report["ratios"]["lora+gc/full peak memory (ours)"], expected)
    expected = medians["ours_lora+compile"]["step_s"] / medians["ours_full+compile"]["step_s"]
    assert math.isclose(report["ratios"]["lora/full step time (ours, compiled)"], expected)
    assert report["process"] == {"keeps_freed_memory": True, "flushes_subnormals": True}
    for target in report["targets"].values():
        bound_ok = target["ratio"] <= target["bound"] if target["kind"] == "max" else target["ratio"] >= target["bound"]
        assert target["met"] == bound_ok
    assert "clear_refs" in report["memory_method"]
    assert "lora/full step time (ours)" in done.stdout  # the table was printed
