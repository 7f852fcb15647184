"""`python -m finetune.demo` end to end in a tiny setting: it pretrains a base, trains an adapter with the default
settings and reports scores before and after."""

from __future__ import annotations

import json

import pytest

from finetune import demo


@pytest.mark.slow
def test_demo_prints_and_writes_scores_before_and_after(tmp_path, capsys):
    out = tmp_path / "demo.json"
    argv = ["--corpus", "40", "--pretrain-steps", "2", "--train", "8", "--valid", "3", "--steps", "2"]
    argv += ["--workdir", str(tmp_path)]
    assert demo.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["n_train"], report["n_valid"], report["steps"]) == (8, 3, 2)
    for scores in (report["before"], report["after"]):
        assert scores["n_examples"] == scores["task_evaluation"]["fields"]["Disposition"]["n"] == 3
        assert scores["loss"] > 0 and 0 <= scores["token_accuracy"] <= 1 and 0 <= demo.disposition_accuracy(scores) <= 1
    assert report["after"]["loss"] < report["before"]["loss"]  # two LoRA steps already help
    assert report["hyperparameters"]["learning_rate"] > 2e-4  # the auto rate, scaled up for the narrow cpu model
    assert (tmp_path / "lora" / "final" / "adapter_config.json").is_file()
    table = capsys.readouterr().out
    assert "base + LoRA" in table and f"{demo.disposition_accuracy(report['after']):.3f}" in table
