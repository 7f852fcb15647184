"""One attempt of a fine-tuning job, in a process of its own:
`python -m server.jobs.attempt <channel dir>/attempt.json`.

The job worker (`server.jobs.worker`) starts it and keeps everything that touches the database (lease, heartbeat,
events, checkpoint rows, the result's registration); this process only trains, so an out-of-memory kill or a crash in
training ends this process, not the worker, and its memory goes back to the system when it exits.

The two talk through files in a private directory the worker makes for the attempt in the host's temporary
directory (`AttemptFiles`), not in the data dir: they are small, and must still be written when the data dir's disk
is full (the attempt's error then says so) or a shared file system is slow:

    attempt.json   the run (model, files, output dir, seed, the job's `method`), the checkpoint to resume from, the
                   worker's pid
    events.jsonl   what the trainer's hooks report, one JSON object a line, appended and flushed as it happens:
                   {"kind": "event" | "metrics" | "checkpoint" | "checkpoint_deleted", ...}
    control        written (atomically) by the worker: "cancel" or "pause" when the user or a shutdown asks for it
    result.json    written (atomically) last: {"status", "output_dir", "metrics", "trained_tokens"} or
                   {"status": "error", ...}

No result file after the process ended means it crashed or was killed: the worker names its exit code or signal.
With several devices the worker starts `torchrun`, which starts one such process per device (data-parallel): the
first (rank 0) reports and writes the result, and decides for all when to stop. When the worker itself dies, the
process stops at its next step (cancel: the job's lease runs out and another attempt resumes from the last
checkpoint the worker recorded).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zaya_model.training.atomic_io import write_json_atomic, write_text_atomic

if TYPE_CHECKING:
    from finetune.run import TrainingHooks

SPEC_FILE = "attempt.json"
EVENTS_FILE = "events.jsonl"
CONTROL_FILE = "control"
RESULT_FILE = "result.json"
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class AttemptFiles:
    directory: Path

    @property
    def spec(self) -> Path:
        return self.directory / SPEC_FILE

    @property
    def events(self) -> Path:
        return self.directory / EVENTS_FILE

    @property
    def control(self) -> Path:
        return self.directory / CONTROL_FILE

    @property
    def result(self) -> Path:
        return self.directory / RESULT_FILE


def write_control(files: AttemptFiles, action: str) -> None:
    """Ask the attempt to stop at its next step ("cancel", or "pause": checkpoint first). Atomic."""
    write_text_atomic(files.control, action)


class EventReader:
    """Reads the complete lines the attempt appended to its events file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as stream:
                stream.seek(self.offset)
                chunk = stream.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.offset += end
        return [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]


def exit_description(returncode: int) -> str:
    """`returncode` of an ended process in words: "was killed by signal SIGKILL (9)" or "exited with code 1"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by signal {name} ({-returncode})"
    if returncode > 128 and returncode - 128 in signal.Signals._value2member_map_:  # a shell or launcher's way
        return f"exited with code {returncode} (signal {signal.Signals(returncode - 128).name})"
    return f"exited with code {returncode}"


# --- the attempt's process -------------------------------------------------------------------------------------------


def _die_with_parent(worker_pid: int) -> None:
    """Linux: be killed when the process that started this one exits (the worker, or a launcher it started)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _hooks(files: AttemptFiles, worker_pid: int, writes_events: bool) -> TrainingHooks:
    from finetune.run import TrainingHooks

    events = open(files.events, "a", encoding="utf-8") if writes_events else None  # noqa: SIM115 (open for the run)

    def emit(kind: str, **fields: Any) -> None:
        if events is not None:
            events.write(json.dumps({"kind": kind, **fields}, allow_nan=True) + "\n")
            events.flush()

    class AttemptHooks(TrainingHooks):
        def on_event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
            emit("event", level=level, message=message, data=data)

        def on_metrics(self, step: int, metrics: dict[str, Any]) -> None:
            emit("metrics", step=step, metrics=metrics)

        def on_checkpoint(self, step: int, path: str, metrics: dict[str, Any]) -> None:
            emit("checkpoint", step=step, path=str(path), metrics=metrics)

        def on_checkpoint_deleted(self, step: int, path: str) -> None:
            emit("checkpoint_deleted", step=step, path=str(path))

        def should_stop(self) -> str | None:
            # Data-parallel processes stop at the same step or not at all: the first decides for all of them.
            decision = [_requested_stop(files, worker_pid) if _rank() == 0 else None]
            if _world_size() > 1:
                import torch.distributed

                torch.distributed.broadcast_object_list(decision, src=0)
            return decision[0]

    return AttemptHooks()


def _requested_stop(files: AttemptFiles, worker_pid: int) -> str | None:
    if not _alive(worker_pid):
        return "cancel"
    try:
        action = files.control.read_text().strip()
    except FileNotFoundError:
        return None
    return action if action in ("cancel", "pause") else None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_attempt(spec_path: Path) -> int:
    from finetune.run import FinetuneError, FineTuneRun, run_finetune
    from finetune.settings import FineTuneSettings
    from zaya_model.training.runtime import prepare_training_process

    spec = json.loads(spec_path.read_text())
    files = AttemptFiles(spec_path.parent)
    worker_pid = spec["worker_pid"]
    _die_with_parent(worker_pid)
    prepare_training_process()  # this process only trains
    run = FineTuneRun(
        model_dir=spec["model_dir"],
        train_file=spec["train_file"],
        validation_file=spec["validation_file"],
        output_dir=spec["output_dir"],
        seed=spec["seed"],
        settings=FineTuneSettings.model_validate(spec["method"]),
    )
    hooks = _hooks(files, worker_pid, writes_events=_rank() == 0)
    try:
        result = run_finetune(run, hooks=hooks, resume_from=spec["resume_from"])
    except Exception as error:
        import traceback

        traceback.print_exc()
        outcome = {
            "status": "error",
            "error_type": type(error).__name__,
            "message": str(error),
            "training_error": isinstance(error, FinetuneError),
        }
        if _rank() == 0:
            write_json_atomic(files.result, outcome)
        return 1
    if _rank() == 0:
        outcome = {
            "status": result.status,
            "output_dir": result.output_dir,
            "metrics": result.metrics,
            "trained_tokens": result.trained_tokens,
        }
        write_json_atomic(files.result, outcome)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m server.jobs.attempt <channel dir>/attempt.json", file=sys.stderr)
        return 2
    return run_attempt(Path(args[0]))


if __name__ == "__main__":
    sys.exit(main())
