"""A run's `checkpoint-<step>` directories: only published ones are listed, rotation keeps the newest and the best."""

from __future__ import annotations

import pytest

from zaya_model.training.checkpoint_dirs import (
    CheckpointWriteError,
    checkpoint_steps,
    latest_checkpoint,
    rotate_checkpoints,
)


def test_only_published_checkpoints_are_listed(tmp_path):
    for name in ("checkpoint-10", "checkpoint-2", ".tmp-checkpoint-12", ".checkpoint-1.deleting", "checkpoint-x"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-11").write_text("a file, not a checkpoint")
    assert checkpoint_steps(tmp_path) == [2, 10]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert checkpoint_steps(tmp_path / "missing") == [] and latest_checkpoint(tmp_path / "missing") is None


def test_rotation_keeps_the_newest_and_the_best(tmp_path):
    for step in (1, 2, 3, 4, 5):
        (tmp_path / f"checkpoint-{step}").mkdir()
    assert rotate_checkpoints(tmp_path, keep_last=2, best_step=2) == [1, 3]
    assert checkpoint_steps(tmp_path) == [2, 4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]
    with pytest.raises(ValueError, match="keep_last"):
        rotate_checkpoints(tmp_path, keep_last=0, best_step=None)


def test_a_checkpoint_write_error_is_an_os_error():
    # Callers that handle a full disk (OSError) handle a failed checkpoint write too.
    assert issubclass(CheckpointWriteError, OSError)
