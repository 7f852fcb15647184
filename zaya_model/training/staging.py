"""A checkpoint save staged in CPU memory: what a background writer may read while training goes on.

A backend (`checkpointer.SingleFileBackend`, `sharded_checkpoint.ShardedBackend`) stages its part of a save as a
`Staged`; `cpu_copy` takes the copy, refilling the previous save's where it can.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


def cpu_copy(value: Any, reuse: Any = None) -> Any:
    """A deep copy with every tensor cloned to CPU memory (what a background writer may read safely).

    `reuse`: an earlier copy of the same structure that nothing reads any more; its tensors are refilled in place
    where shape and dtype match. Fresh memory costs a page fault per page on first write, so refilling a copy is
    much faster than making a new one.
    """
    if isinstance(value, torch.Tensor):
        if (
            isinstance(reuse, torch.Tensor)
            and reuse.device.type == "cpu"
            and reuse.shape == value.shape
            and reuse.dtype == value.dtype
        ):
            return reuse.copy_(value.detach())
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        previous = reuse if isinstance(reuse, dict) else {}
        return {key: cpu_copy(item, previous.get(key)) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        olds = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(value) else [None] * len(value)
        return type(value)(cpu_copy(item, old) for item, old in zip(value, olds, strict=True))
    return value


@dataclass
class Staged:
    """A backend's part of one save, staged: `write()` (run on the writer thread) puts the model and optimizers
    into the temporary directory and returns its timings; `training_state` is what it adds to `training_state.pt`."""

    write: Callable[[], dict[str, float]]
    training_state: dict[str, Any] = field(default_factory=dict)
