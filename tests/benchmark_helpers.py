"""Running a benchmark as its user does, `python -m benchmarks.<name> ...` from the repository root, for the tests
that check its report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(
    name: str, *arguments: str, timeout: float | None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`benchmarks.<name>` with `arguments` in a child process (`env`: its whole environment, default this one's),
    its output captured as text."""
    command = [sys.executable, "-m", f"benchmarks.{name}", *arguments]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def output_tail(done: subprocess.CompletedProcess[str]) -> str:
    """The end of a run's output, for the message of an assertion on it."""
    return done.stdout[-2000:] + done.stderr[-3000:]
