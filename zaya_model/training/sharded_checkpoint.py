"""The sharded backend of `Checkpointer`: the model and optimizers through `torch.distributed.checkpoint` (DCP), every
rank writing its own shard.

In `checkpoint-<step>/`, `distributed/` holds the model and optimizer state as DCP wrote it, one `__<rank>_0.distcp`
file per rank (each holds that rank's FSDP shards, written in parallel) plus `.metadata`, which maps every tensor's
global shape to the pieces. Loading plans against the global shapes, so a checkpoint written by N processes loads
into M processes (or into one unsharded model) and DCP reshards. The rest of the checkpoint (`training_state.pt`, the
tokenizer) is `Checkpointer`'s. It is not a `save_pretrained` directory: the trainer exports the final model by
gathering the full state dict.

Saves are asynchronous (`dcp.async_save`): training stalls while DCP stages the state into a CPU copy, then a background
thread writes the shards. The backend keeps one stager, whose CPU copy is allocated at the first save and reused by
later ones (a save starts only after the previous write finished): a fresh copy stalls training mostly on page faults,
which refilling the kept one avoids. (So a rank holds a CPU copy of its shards between saves, not only during them; the
peak is the same.) The writer thread coordinates ranks over a dedicated gloo group so it never interleaves with the
training step's collectives. On rank 0 `Checkpointer`'s writer thread waits for that write (DCP's coordinator writes
`.metadata` only after every rank reported its shard written), then adds the rest, fsyncs and renames the directory into
place.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from .staging import Staged

SHARDS_DIR = "distributed"
# One process saves and loads with `no_dist=True` on purpose; DCP warns about it all the same.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def sharded_state(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter name (not by position), so any world size can load it."""
    fresh = [optimizer for optimizer in optimizers if not optimizer.state]
    if fresh:
        # DCP materialises an empty optimizer state by running one step with zero gradients and lr 0, which leaves
        # Adam's moments at zero but counts a step (and so changes the next step's bias correction). Undo the count:
        # zero moments at step 0 are exactly the state the first real step would create.
        get_optimizer_state_dict(model, fresh)
        for optimizer in fresh:
            for state in optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"].zero_()
    model_state, optimizer_state = get_state_dict(model, optimizers)
    return {"model": model_state, "optimizers": optimizer_state}


def load_sharded(directory: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """Load a checkpoint's model and optimizer state in place, resharding to this run's world size (collective)."""
    state = sharded_state(model, optimizers)
    dcp.load(state, checkpoint_id=directory / SHARDS_DIR, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizers"])


class ShardedBackend:
    """Every rank stages and writes its own shards of the model and optimizers (`stage` and `load` are collective:
    every rank calls them at the same point)."""

    every_rank_writes = True

    def __init__(self):
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        # Collective: every rank builds its backend at the same point of set-up.
        self.group = dist.new_group(backend="gloo") if distributed else None
        self._stager = _kept_stager()

    def stage(self, temporary: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> Staged:
        started = time.perf_counter()
        state = sharded_state(model, optimizers)
        shards = temporary / SHARDS_DIR
        shards.mkdir(parents=True, exist_ok=True)
        saving = dcp.async_save(
            state,
            checkpoint_id=shards,
            process_group=self.group,
            no_dist=self.group is None,
            async_stager=self._stager,
        )
        # A stager that stages asynchronously gets a response with a future for each phase; ours stages in place.
        written = saving.upload_completion if isinstance(saving, AsyncSaveResponse) else saving

        def write() -> dict[str, float]:
            written.result()  # every rank's shard (and, on rank 0, the metadata) is on disk
            return {"shards_s": time.perf_counter() - started}

        return Staged(write)

    def load(self, directory: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], state: dict):
        load_sharded(directory, model, optimizers)

    def release(self) -> None:
        self._stager.close()  # drops its cached CPU storages
        self._stager = _kept_stager()


def _kept_stager() -> DefaultStager:
    """Synchronous staging into CPU memory that later saves refill (pinned where a GPU copies from it)."""
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=torch.cuda.is_available(),
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )
