"""Checkpoint rotation for fine-tuning: keep the newest `keep_last` checkpoints and the best by validation loss."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

_CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """Steps of the published `checkpoint-<step>` directories under `run_dir`, ascending (staging dirs ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    matches = (_CHECKPOINT_NAME.fullmatch(path.name) for path in run_dir.iterdir() if path.is_dir())
    return sorted(int(match.group(1)) for match in matches if match)


def rotate_checkpoints(run_dir: str | Path, keep_last: int, best_step: int | None) -> list[int]:
    """Delete every checkpoint but the newest `keep_last` and `best_step`; return the deleted steps.

    A checkpoint is removed by renaming it to a hidden name first, so a crash mid-delete never leaves a published
    `checkpoint-<step>` with half its files.
    """
    run_dir = Path(run_dir)
    for leftover in run_dir.glob(".checkpoint-*.deleting"):  # a delete interrupted by a crash
        shutil.rmtree(leftover, ignore_errors=True)
    steps = checkpoint_steps(run_dir)
    keep = set(steps[-keep_last:])
    if best_step is not None:
        keep.add(best_step)
    deleted = [step for step in steps if step not in keep]
    for step in deleted:
        doomed = run_dir / f".checkpoint-{step}.deleting"
        (run_dir / f"checkpoint-{step}").rename(doomed)
        shutil.rmtree(doomed)
    return deleted
