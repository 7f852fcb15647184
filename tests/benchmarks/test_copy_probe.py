"""`python -m benchmarks.copy_probe`: the induction probe learns to copy at a short distance, and the notes probe
scores a pretrained base's closing notes."""

import json
import math

from pretrain_helpers import MICRO, write_case_corpus

from benchmarks import copy_probe
from zaya_model.pretrain.train import Pretrainer


def test_induction_probe_reports_when_the_model_starts_copying(tmp_path, capsys):
    out = tmp_path / "induction.json"
    # A block 16 tokens back, RoPE base 10,000: copied within ~90 steps (a model that does not copy stays at ~5.5).
    options = ["--distance", "16", "--batch", "16", "--rope-theta", "1e4", "--width", "64", "--lr", "1e-2"]
    copy_probe.main(["induction", *options, "--steps", "150", "--out", str(out)])
    report = json.loads(out.read_text())
    assert len(report["losses"]) == 150 and report["losses"][0] > math.log(copy_probe.VOCAB) - 0.5
    assert report["copied_at_step"] is not None and report["final_loss"] < copy_probe.COPIED_LOSS
    assert "copied at step" in capsys.readouterr().out


def test_notes_probe_scores_the_closing_notes_a_base_writes(tmp_path):
    corpus = write_case_corpus(tmp_path / "corpus.jsonl")
    Pretrainer(corpus, tmp_path / "base", MICRO.replace(max_steps=2)).train()
    out = tmp_path / "notes.json"

    copy_probe.main(["notes", "--base", str(tmp_path / "base"), "--cases", "3", "--out", str(out)])

    report = json.loads(out.read_text())
    assert report["cases"] == 3 and report["exact_match"] == 1 - len(report["misses"]) / 3
    for miss in report["misses"]:  # an untrained base misses: each miss shows the note it should have written
        assert miss["expected"].startswith("Disposition: ")
