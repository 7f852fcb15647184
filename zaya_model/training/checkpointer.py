"""One checkpointer for a training run: `Stateful` objects written atomically in the background, the last K and the
best by validation loss kept.

A run builds one `Checkpointer` from its model, its optimizers and every other object whose state a resume needs,
each `Stateful` (`state_dict()` and `load_state_dict()`, the protocol of `torch.distributed.checkpoint`): the
schedulers, the balancing-bias updater, the data stream's position, the trainer's own counters and RNG. The storage
of the model and optimizers is chosen once, by the backend:
- `SingleFileBackend`: the model as `save_pretrained` writes it (the upstream `zaya` layout, so `from_pretrained` and
  stock transformers read a checkpoint), the optimizers' state in `training_state.pt`; one process writes;
- `ShardedBackend` (`sharded_checkpoint.py`): model and optimizers through `torch.distributed.checkpoint`, every
  rank writing its own shard; a checkpoint written by N processes loads into M.
Either way `checkpoint-<step>/` also holds the tokenizer and `training_state.pt`, where every other object's state
sits under its name.

Saving stalls training only while the state is copied to CPU memory (into the previous save's copy, whose pages are
already mapped, so that copy stays allocated between saves until `release`; the peak is the same); a background thread
then writes the copy into `.tmp-checkpoint-<step>`, fsyncs every file and the directory, and renames it into place, so
a crash never leaves a half-written `checkpoint-<step>`. `index.json` (written the same way) records each checkpoint's
validation loss and which one is best. One write runs at a time: a save waits for the previous one.

Each finished write appends its timings to `completed_writes`: `stall_s` (training paused: `wait_s` waiting for the
previous write, plus the CPU copy), the backend's own (`save_pretrained_s`: what the same `save_pretrained` would have
stalled training for had it run synchronously; `shards_s`: until every rank's shard was on disk) and `write_s` (the
whole background write).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.stateful import Stateful
from transformers import PreTrainedModel

from .atomic_io import publish_directory, write_json_atomic
from .checkpoint_dirs import (
    CHECKPOINT_PREFIX,
    CheckpointWriteError,
    checkpoint_name,
    checkpoint_steps,
    latest_checkpoint,
    rotate_checkpoints,
)
from .staging import Staged, cpu_copy

TRAINING_STATE_FILE = "training_state.pt"
INDEX_FILE = "index.json"


def load_model_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load a `save_pretrained` directory's weights into `model` in place (tied weights are stored once)."""
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        shard_names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    else:
        shard_names = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in shard_names:
        state.update(load_file(directory / name))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    if unexpected or set(missing) - tied:
        raise ValueError(f"checkpoint {directory} does not match the model: missing {missing}, unexpected {unexpected}")


class SingleFileBackend:
    """The model as `save_pretrained` writes it, the optimizers' state in `training_state.pt`; rank 0 writes (the
    other ranks hold the same replicated state)."""

    every_rank_writes = False

    def __init__(self):
        self._model_copy: dict[str, torch.Tensor] | None = None  # the last save's, refilled by the next

    def stage(self, temporary: Path, model: PreTrainedModel, optimizers: list[torch.optim.Optimizer]) -> Staged:
        model_state = cpu_copy(model.state_dict(), self._model_copy)
        self._model_copy = model_state

        def write() -> dict[str, float]:
            started = time.perf_counter()
            temporary.mkdir()
            model.save_pretrained(temporary, state_dict=model_state)
            return {"save_pretrained_s": time.perf_counter() - started}

        return Staged(write, {"optimizers": [optimizer.state_dict() for optimizer in optimizers]})

    def load(self, directory: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], state: dict):
        load_model_weights(model, directory)
        for optimizer, saved in zip(optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)

    def release(self) -> None:
        self._model_copy = None


class Checkpointer:
    """Saves and loads a run's state (`model`, `optimizers` and the named `states`) as `checkpoint-<step>` in
    `directory`. `save` is collective when every rank writes (the sharded backend); `load` is collective there too."""

    def __init__(
        self,
        directory: str | Path,
        model: PreTrainedModel,
        optimizers: list[torch.optim.Optimizer],
        states: dict[str, Stateful],
        tokenizer,
        keep_last: int,
        sharded: bool = False,
        is_main: bool = True,
        after_write: Callable[[int], None] | None = None,
    ):
        """`sharded` chooses the backend; `is_main`: this process writes what is not sharded (rank 0);
        `after_write(step)` runs on the writer thread once a checkpoint is in place (e.g. to redraw a plot)."""
        if keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        if "optimizers" in states:
            raise ValueError("'optimizers' names the optimizers' own entry of the training state")
        self.directory = Path(directory)
        self.model, self.optimizers, self.states, self.tokenizer = model, optimizers, states, tokenizer
        self.keep_last = keep_last
        self.is_main = is_main
        if sharded:
            from .sharded_checkpoint import ShardedBackend  # torch.distributed.checkpoint only where used

            self.backend: SingleFileBackend | ShardedBackend = ShardedBackend()
        else:
            self.backend = SingleFileBackend()
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".tmp-*") if is_main else ():  # a write interrupted by a crash
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        index_path = self.directory / INDEX_FILE
        self.index: dict[str, Any] = json.loads(index_path.read_text()) if index_path.is_file() else {}
        self.index.setdefault("val_loss", {})
        self.index.setdefault("best_step", None)
        self.completed_writes: list[dict[str, float]] = []  # timings of finished writes, drained by the trainer
        self.after_write = after_write
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._state_copy: dict[str, Any] | None = None  # the last save's training state, refilled by the next

    def steps(self) -> list[int]:
        return checkpoint_steps(self.directory)

    def path(self, step: int) -> Path:
        return self.directory / checkpoint_name(step)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.directory)

    def best(self) -> Path | None:
        step = self.index["best_step"]
        return self.path(step) if step is not None and self.path(step).is_dir() else None

    def save(self, step: int, val_loss: float | None = None, block: bool = False) -> float:
        """Snapshot the state and write it in the background; returns the seconds training was stalled."""
        started = time.perf_counter()
        self.wait()
        wait_s = time.perf_counter() - started
        if not (self.is_main or self.backend.every_rank_writes):
            return time.perf_counter() - started
        temporary = self.directory / f".tmp-{CHECKPOINT_PREFIX}{step}"
        staged = self.backend.stage(temporary, self.model, self.optimizers)
        training_state = None
        if self.is_main:
            # The previous write has finished (waited for above): its copy can be refilled.
            live = {name: state.state_dict() for name, state in self.states.items()} | staged.training_state
            training_state = self._state_copy = cpu_copy(live, self._state_copy)
        stall_s = time.perf_counter() - started
        self._writer = threading.Thread(
            target=self._write_guarded,
            args=(step, temporary, staged, training_state, val_loss, (stall_s, wait_s)),
            name=f"checkpoint-{step}",
            daemon=False,
        )
        self._writer.start()
        if block:
            self.wait()
        return stall_s

    def load(self, directory: Path) -> None:
        """Load a checkpoint into the model, the optimizers and every state, in place."""
        state = load_training_state(directory)
        missing = sorted(set(self.states) - set(state))
        if missing:
            raise ValueError(
                f"checkpoint {directory} holds no state for {missing}: another trainer or version wrote it"
            )
        self.backend.load(directory, self.model, self.optimizers, state)
        for name, stateful in self.states.items():
            stateful.load_state_dict(state[name])

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; re-raise its error."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointWriteError(f"writing a checkpoint failed: {error}") from error

    def release(self) -> None:
        """Wait for the write in flight, then free the CPU copies kept for the next save (training is over)."""
        self.wait()
        self._state_copy = None
        self.backend.release()

    def _write_guarded(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as error:  # surfaced on the training thread by wait()
            self._error = error

    def _write(self, step, temporary, staged, training_state, val_loss, stalls) -> None:
        started = time.perf_counter()
        timing = {"step": step, "stall_s": stalls[0], "wait_s": stalls[1], **staged.write()}
        if not self.is_main:  # this rank's shard is on disk; rank 0 puts the checkpoint in place
            return
        self.tokenizer.save_pretrained(temporary)
        torch.save(training_state, temporary / TRAINING_STATE_FILE)
        # The same step saved again after a rollback replaces the older one, never leaving the step missing.
        publish_directory(temporary, self.path(step))
        self._record(step, val_loss)
        self.completed_writes.append({**timing, "write_s": time.perf_counter() - started})
        if self.after_write is not None:
            self.after_write(step)

    def _record(self, step: int, val_loss: float | None) -> None:
        if val_loss is not None:
            self.index["val_loss"][str(step)] = val_loss
            best = self.index["best_step"]
            if best is None or val_loss < self.index["val_loss"].get(str(best), float("inf")):
                self.index["best_step"] = step
        for old in rotate_checkpoints(self.directory, self.keep_last, self.index["best_step"]):
            self.index["val_loss"].pop(str(old), None)
        write_json_atomic(self.directory / INDEX_FILE, self.index)


def load_training_state(directory: Path) -> dict[str, Any]:
    # Our own file: it holds Python RNG state and plain containers besides tensors.
    return torch.load(directory / TRAINING_STATE_FILE, map_location="cpu", weights_only=False)
