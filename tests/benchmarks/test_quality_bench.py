"""Smoke test of `python -m benchmarks.quality_bench --smoke`: corpus, pretraining, sample chats, base and both
fine-tunes scored, with the hyperparameters the defaults resolved to."""

import json
import math

import pytest
from benchmark_helpers import output_tail, run_benchmark


@pytest.mark.slow
def test_smoke_quality_benchmark_scores_base_lora_and_full(tmp_path):
    out = tmp_path / "results" / "quality.json"
    done = run_benchmark(
        "quality_bench",
        *("--smoke", "--variant", "ledger", "--seed", "3", "--workdir", str(tmp_path / "work"), "--out", str(out)),
        timeout=400,  # ~20-40 s on 2 loaded cores
    )
    assert done.returncode == 0, output_tail(done)
    report = json.loads(out.read_text())
    assert list(report["models"]) == ["base", "lora", "full"]
    for scores in report["models"].values():
        assert math.isfinite(scores["loss"]) and scores["loss"] > 0
        for name in ("token_accuracy", "exact_match", "disposition_accuracy", "threshold_accuracy"):
            assert 0 <= scores[name] <= 1
    for method in ("lora", "full"):
        hyper = report["models"][method]["hyperparameters"]
        assert hyper["n_epochs"] >= 1 and hyper["batch_size"] >= 1 and hyper["learning_rate"] > 0
        assert report["models"][method]["steps"] == 2  # --smoke caps each fine-tune at 2 steps
    # the full fine-tune's rate is LoRA's / 10, both scaled to the same narrow model
    assert math.isclose(
        report["models"]["lora"]["hyperparameters"]["learning_rate"],
        10 * report["models"]["full"]["hyperparameters"]["learning_rate"],
    )
    phases = {
        "pretrain",
        "evaluate_base",
        "threshold_base",
        "finetune_lora",
        "threshold_lora",
        "threshold_full",
        "total",
    }
    assert set(report["seconds"]) >= phases and set(report["cpu_seconds"]) == set(report["seconds"])
    for phase, seconds in report["cpu_seconds"].items():  # the idle estimate: CPU seconds over the threads
        assert math.isclose(report["seconds_idle_estimate"][phase], round(seconds / report["threads"], 1))
    assert report["seed"] == 3  # the pretraining's, instead of the preset's 0
    assert report["variant"] == "ledger" and report["parameters"] > 0 and report["pretrain_tokens"] > 0
    assert report["n_threshold"] == 2  # --smoke's sanctions-threshold chats, one SAR and one ESCALATE
    # --smoke runs the copying start (2 steps) and a copying row in each batch
    assert report["copying_start"]["steps"] == 2 and report["copy_rows"] == 1 and report["copying_loss"] > 0
    table = done.stdout
    assert (
        "disposition" in table
        and "exact match" in table
        and "sanctions threshold" in table
        and f"{report['models']['base']['loss']:.3f}" in table
    )
    assert "variant ledger" in table and "idle estimate" in table
    assert "copying start of 2 steps (does not copy yet), 1 copying rows a batch" in table
    # A base from that run, fine-tuned again: the report names it instead of a preset it did not come from.
    again = tmp_path / "again.json"
    reused = run_benchmark(
        "quality_bench",
        *(
            "--smoke",
            "--base",
            str(tmp_path / "work" / "base"),
            "--methods",
            "lora",
            "--skip-base",
            "--out",
            str(again),
        ),
        timeout=400,
    )
    assert reused.returncode == 0, output_tail(reused)
    report = json.loads(again.read_text())
    assert list(report["models"]) == ["lora"] and 0 <= report["models"]["lora"]["threshold_accuracy"] <= 1
    assert report["preset"] is None and report["base"] == str(tmp_path / "work" / "base")
    assert f"base {tmp_path / 'work' / 'base'}, variant standard" in reused.stdout
    refused = run_benchmark("quality_bench", "--smoke", "--variant", "prose", timeout=300)
    assert refused.returncode == 2 and "--variant: unknown variant 'prose'" in refused.stderr
    too_few = run_benchmark("quality_bench", "--threshold-chats", "1", timeout=300)
    assert too_few.returncode == 2 and "--threshold-chats: at least 2" in too_few.stderr
