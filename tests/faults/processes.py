"""Waiting on real processes and on what they leave in the database and on disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from benchmarks.load_test.stack import Stack
from server.jobs.attempt import AttemptFiles

T = TypeVar("T")


def dataset(examples: int) -> bytes:
    """A valid chat dataset (the fine-tuning validator accepts it: distinct examples)."""
    return b"".join(
        b'{"messages": [{"role": "user", "content": "Balance of account %d?"}, '
        b'{"role": "assistant", "content": "It is %d EUR."}]}\n' % (i, 100 + i)
        for i in range(examples)
    )


DATASET = dataset(8)


def wait_for(predicate: Callable[[], T], timeout: float, stack: Stack, what: str, poll: float = 0.05) -> T:
    """Poll until `predicate()` is truthy; fail with the stack's logs on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out waiting for {what}\n{logs(stack)}")


def logs(stack: Stack) -> str:
    return f"--- server log\n{Stack.tail(stack.server_log)}\n--- worker log\n{Stack.tail(stack.worker_log)}"


def descendants(pid: int) -> list[int]:
    """The pids of the process's children and theirs (a worker's training process), from /proc."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return children + [grandchild for child in children for grandchild in descendants(child)]


@dataclass(frozen=True)
class TrainingProcess:
    pid: int
    reports: Path  # the events file it appends to (`server.jobs.attempt`)


def training_process(worker_pid: int) -> TrainingProcess | None:
    """The worker's running training process (`python -m server.jobs.attempt <dir>/attempt.json`), if any."""
    for pid in descendants(worker_pid):
        try:
            arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if "server.jobs.attempt" in arguments:
            spec = Path(arguments[arguments.index("server.jobs.attempt") + 1])
            return TrainingProcess(pid, AttemptFiles(spec.parent).events)
    return None


def training_reports(events: Path) -> list[dict]:
    """The complete records a training process has reported so far."""
    try:
        lines = events.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("\n")]


def freeze(process: subprocess.Popen) -> None:
    """SIGSTOP to the process and its descendants: they stop where they are, so the test can look at the state they
    are about to be killed in."""
    process.send_signal(signal.SIGSTOP)
    for pid in descendants(process.pid):
        os.kill(pid, signal.SIGSTOP)


def thaw(process: subprocess.Popen) -> None:
    """SIGCONT to a frozen process and its descendants."""
    for pid in descendants(process.pid):
        os.kill(pid, signal.SIGCONT)
    process.send_signal(signal.SIGCONT)


def kill(process: subprocess.Popen) -> None:
    """SIGKILL (works on a frozen process too): no handler, no cleanup, as in a crash or an OOM kill. A worker's
    training process dies with it (its parent-death signal)."""
    process.send_signal(signal.SIGKILL)
    process.wait()


def visible_files(directory: Path) -> set[str]:
    """What a listing of the directory shows, leaving out dot-entries (temp files being written)."""
    return {path.name for path in directory.iterdir() if not path.name.startswith(".")} if directory.exists() else set()


def assert_no_secret_logged(stack: Stack) -> None:
    """The processes' logs (crash tracebacks included) never hold a key's secret part."""
    from server.services.keys import PREFIX_LENGTH

    for path in (stack.server_log, stack.worker_log):
        text = path.read_text(errors="replace") if path.exists() else ""
        for secret in stack.keys.values():
            assert secret[PREFIX_LENGTH:] not in text, f"a key's secret is in {path.name}"
