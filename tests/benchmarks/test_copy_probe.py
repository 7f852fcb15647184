"""`python -m benchmarks.copy_probe`: the induction probe's rows, its report of when a model starts copying, and the
notes probe's scores of a pretrained base's closing notes."""

import json
import math

import torch
from pretrain_helpers import MICRO, write_case_corpus

from benchmarks import copy_probe
from zaya_model.pretrain.train import Pretrainer


def test_varied_rows_put_each_copy_its_own_distance_back():
    torch.manual_seed(0)
    ids, labels = copy_probe.copy_batch(rows=32, distance=40, varied=True)

    assert ids.shape == labels.shape == (32, 81) and (ids[:, 0] == 0).all()
    distances = set()
    for row_ids, row_labels in zip(ids, labels, strict=True):
        labelled = (row_labels != -100).nonzero().flatten()
        length = int(labelled[0]) - 2  # BOS, the block, then the repeat's first token (unlabelled)
        distances.add(length)
        assert (row_labels[labelled] == row_ids[labelled]).all()
        assert (row_ids[labelled] == row_ids[labelled - length]).all()  # each labelled token is a copy
        assert len(labelled) == length - 1 and copy_probe.MIN_BLOCK <= length <= 40
    assert len(distances) > 10  # a fixed-offset head cannot solve these rows


def test_fixed_rows_repeat_every_block_at_the_same_distance():
    ids, labels = copy_probe.copy_batch(rows=4, distance=16, varied=False)
    assert ((labels != -100).sum(dim=1) == 15).all()
    assert (ids[:, 17:33] == ids[:, 1:17]).all()


def test_induction_probe_reports_when_the_model_starts_copying(tmp_path, capsys):
    out = tmp_path / "induction.json"
    # A block 16 tokens back in every row, RoPE base 10,000: copied within ~90 steps by a head that attends 16
    # tokens back (a model that does not copy stays at ~5.5).
    options = ["--offset", "fixed", "--distance", "16", "--rope-theta", "1e4", "--width", "64", "--lr", "1e-2"]
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
