"""Smoke test of `python -m benchmarks.pretrain_bench --quick`: it runs end to end and reports every metric, upstream
`transformers` `zaya` under the same Trainer, eager/eager and best/best ratios and the targets included."""

import json
import math
import time

import pytest
from benchmark_helpers import output_tail, run_benchmark


def _positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_quick_pretrain_benchmark_reports_speed_mfu_and_checkpoint_stall(tmp_path):
    out = tmp_path / "results" / "pretrain.json"
    # ~1-2 min on 2 loaded cores (compiling included); generous so a busy CI runner does not flake
    done = run_benchmark("pretrain_bench", "--quick", "--threads", "1", "--out", str(out), timeout=400)
    assert done.returncode == 0, output_tail(done)
    report = json.loads(out.read_text())

    assert report["mode"] == "quick"
    dtypes = list(report["matmul"]["gflops"])
    assert dtypes == (["fp32"] if report["bf16_skipped"] else ["fp32", "bf16"])
    assert all(_positive(value) for value in report["matmul"]["gflops"].values())
    assert [entry["dtype"] for entry in report["results"]] == dtypes
    for entry in report["results"]:
        assert entry["rounds"] == 1  # the micro shape's
        for impl in ("ours", "ours_compiled", "trainer", "upstream"):
            # --quick times 3 steps after the 2 untimed ones, each between two readings of the benchmark's clock
            assert len(entry["tokens_per_s"][impl]) == 3 and all(map(_positive, entry["tokens_per_s"][impl]))
            assert _positive(entry["gflops"][impl]) and 0 < entry["mfu_vs_matmul"][impl] < 1
        assert "upstream_compiled" in entry["not_measured"] and "upstream_compiled" not in entry["tokens_per_s"]
        for ratio in (
            "ours_over_trainer",
            "ours_over_upstream",
            "best_over_best",
            "trainer_ours_over_upstream",
            "flops_per_token",
        ):
            assert _positive(entry[ratio])
        median = entry["median_tokens_per_s"]
        assert math.isclose(entry["ours_over_upstream"], median["ours"] / median["upstream"])
        ours_best = max(median["ours"], median["ours_compiled"])
        assert math.isclose(entry["best_over_best"], ours_best / median["upstream"])
        expected = {"best_over_best", "mfu_vs_matmul_ours", "mfu_vs_matmul_ours_compiled"}
        if entry["dtype"] == "fp32":
            expected |= {"ours_over_upstream"}
        assert set(entry["targets"]) == expected
        for name, target in entry["targets"].items():
            value = entry["mfu_vs_matmul"][name.removeprefix("mfu_vs_matmul_")] if "mfu" in name else entry[name]
            assert target["value"] == value and target["met"] == (value >= target["min"])
    assert report["process"] == {"keeps_freed_memory": True, "flushes_subnormals": True}
    for impl in ("ours_2proc_none", "ours_2proc_fsdp"):  # fp32 only
        assert _positive(report["results"][0]["median_tokens_per_s"][impl])
    checkpoint = report["results"][0]["checkpoint"]
    assert set(checkpoint) == {"replicated", "sharded_dcp"}
    for timing in checkpoint.values():
        assert timing["checkpoints"] == 3  # steps 0, 2 and 4
        assert 0 <= timing["waiting_for_previous_write_s"] <= timing["stall_s"]
        assert _positive(timing["background_write_s"]) and _positive(timing["sync_save_pretrained_s"])
    assert "| micro | fp32 |" in done.stdout and "| micro | sharded_dcp |" in done.stdout
    assert "micro fp32 ours_over_upstream:" in done.stdout and "micro fp32 best_over_best:" in done.stdout


def test_full_shapes_include_the_recipe_preset_and_are_selectable():
    from benchmarks import pretrain_bench
    from zaya_model.pretrain.presets import PRESETS

    assert [shape["name"] for shape in pretrain_bench.shapes(quick=False)] == ["tiny", "cpu", "wide-512"]
    args = pretrain_bench.parse_args(["--shapes", "cpu", "--clock", "cpu", "--threads", "1"])
    (recipe,) = pretrain_bench.selected_shapes(args)
    assert recipe["model"] == PRESETS["cpu"].model and recipe["seq_len"] == PRESETS["cpu"].seq_len
    assert pretrain_bench.CLOCKS[args.clock] is time.process_time
    assert args.rounds is None  # each shape's own number of rounds
    assert pretrain_bench.parse_args(["--rounds", "6"]).rounds == 6
    with pytest.raises(SystemExit):
        pretrain_bench.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit, match="unknown"):
        pretrain_bench.selected_shapes(pretrain_bench.parse_args(["--shapes", "huge"]))


def test_impls_choose_what_runs_and_ratios_without_an_implementation_are_absent():
    from benchmarks import pretrain_bench

    assert pretrain_bench.selected_impls(pretrain_bench.parse_args([])) == pretrain_bench.IMPLS
    assert pretrain_bench.selected_impls(pretrain_bench.parse_args(["--quick"])) == pretrain_bench.QUICK_IMPLS
    args = pretrain_bench.parse_args(["--impls", "trainer", "ours"])
    assert pretrain_bench.selected_impls(args) == ("ours", "trainer")  # in IMPLS order
    assert pretrain_bench.not_measured(args, ("ours", "trainer")) == {
        impl: "not in --impls" for impl in ("ours_compiled", "upstream", "upstream_compiled")
    }
    with pytest.raises(SystemExit):
        pretrain_bench.parse_args(["--impls", "nothing"])

    median = {"ours": 1200.0, "trainer": 1000.0}
    entry = {"shape": "tiny", "dtype": "fp32", **pretrain_bench.ratios(median)}
    assert entry["ours_over_trainer"] == 1.2
    assert entry["ours_over_upstream"] is None and entry["best_over_best"] is None
    assert entry["trainer_ours_over_upstream"] is None and entry["best"] == {"ours": "ours", "upstream": None}
    entry |= {
        "median_tokens_per_s": median,
        "gflops": {impl: speed * 1e-6 for impl, speed in median.items()},
        "mfu_vs_matmul": {impl: speed * 1e-8 for impl, speed in median.items()},
        "not_measured": pretrain_bench.not_measured(args, ("ours", "trainer")),
    }
    entry["targets"] = pretrain_bench.targets(entry)
    assert entry["targets"]["best_over_best"] == {"value": None, "min": 1.0, "met": None}
    assert entry["targets"]["mfu_vs_matmul_ours_compiled"]["met"] is None
    assert entry["targets"]["mfu_vs_matmul_ours"] == {"value": 1.2e-5, "min": 0.5, "met": False}

    report = {
        "machine": {"clock": "cpu", "threads": 1},
        "matmul": {"size": 2048, "gflops": {"fp32": 100.0}},
        "results": [entry],
        "bf16_skipped": None,
    }
    table = pretrain_bench.table(report)
    assert "| tiny | fp32 | 1200 | n/a | 1000 | n/a | n/a | n/a | n/a | n/a | 1.20 |" in table
    assert "- tiny fp32 best_over_best: n/a (>= 1.0) absent" in table
    assert "- tiny fp32 upstream not measured: not in --impls" in table
