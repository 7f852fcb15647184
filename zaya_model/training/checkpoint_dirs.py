"""The `checkpoint-<step>` directories of a training run, pretraining's and fine-tuning's alike: their names, listing,
the newest, rotation (the newest K and the best kept), and the one error a failed checkpoint write raises.

Only published directories count: a checkpoint is written under a hidden temporary name and renamed into place, and
rotation renames a checkpoint to a hidden name before deleting it, so a crash in the middle of either never leaves a
`checkpoint-<step>` with half its files.

Standard library only, so the server can list a run's checkpoints without loading torch.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

CHECKPOINT_PREFIX = "checkpoint-"
_CHECKPOINT_NAME = re.compile(rf"{CHECKPOINT_PREFIX}(\d+)")
_DELETING_SUFFIX = ".deleting"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (full disk, permissions, ...); earlier checkpoints are intact."""


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step}"


def checkpoint_steps(directory: str | os.PathLike[str]) -> list[int]:
    """The steps of the published `checkpoint-<step>` directories in `directory`, ascending (none if it is missing;
    temporary and half-deleted ones are hidden names, never listed)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    matches = (_CHECKPOINT_NAME.fullmatch(path.name) for path in directory.iterdir() if path.is_dir())
    return sorted(int(match.group(1)) for match in matches if match)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest published checkpoint in `directory`, if any."""
    steps = checkpoint_steps(directory)
    return Path(directory) / checkpoint_name(steps[-1]) if steps else None


def rotate_checkpoints(directory: str | os.PathLike[str], keep_last: int, best_step: int | None) -> list[int]:
    """Delete every checkpoint but the newest `keep_last` and `best_step`; return the deleted steps, ascending.

    A checkpoint is renamed to a hidden name before it is deleted; a delete interrupted by a crash is finished here.
    """
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1")
    directory = Path(directory)
    for leftover in directory.glob(f".{CHECKPOINT_PREFIX}*{_DELETING_SUFFIX}"):
        shutil.rmtree(leftover, ignore_errors=True)
    steps = checkpoint_steps(directory)
    keep = set(steps[-keep_last:])
    if best_step is not None:
        keep.add(best_step)
    deleted = [step for step in steps if step not in keep]
    for step in deleted:
        doomed = directory / f".{checkpoint_name(step)}{_DELETING_SUFFIX}"
        (directory / checkpoint_name(step)).rename(doomed)
        shutil.rmtree(doomed)
    return deleted
