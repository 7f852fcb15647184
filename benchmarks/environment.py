"""What every benchmark shares: the process environment, thread counts, the JSON report and the printed tables.

`benchmarks/__init__.py` calls `set_process_defaults()`, so running any benchmark as `python -m benchmarks.<name>`
sets the environment before the benchmark's own imports (Hugging Face reads `HF_HUB_OFFLINE` when it is imported).
It imports neither torch nor transformers: the serving benchmarks choose where torch runs before they import it.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from zaya_model.training.atomic_io import write_json_atomic

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEFAULT_THREADS = 2  # the CPU benchmarks' torch threads unless `--threads` says otherwise

PROCESS_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",  # every model is built locally; nothing is downloaded
    "TOKENIZERS_PARALLELISM": "false",
}
VLLM_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: the benchmarks' small models' KV cache on CPU
    "VLLM_NO_USAGE_STATS": "1",
}


def set_process_defaults() -> None:
    """The environment every benchmark and the processes it starts run with; variables already set are kept."""
    for name, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(name, value)


def set_vllm_defaults() -> None:
    """What the vLLM engines a serving benchmark starts run with (vLLM reads it when an engine starts, so the
    benchmark's `main` sets it); variables already set are kept."""
    for name, value in VLLM_DEFAULTS.items():
        os.environ.setdefault(name, value)


def use_threads(threads: int) -> int:
    """Compute on `threads` torch threads, in this process and (through `OMP_NUM_THREADS`) in those it starts."""
    if threads < 1:
        raise SystemExit("--threads must be at least 1")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    return threads


def default_out(name: str) -> Path:
    """The report path of benchmark `name` when `--out` is not given (git-ignored)."""
    return RESULTS_DIR / f"{name}.json"


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Write the JSON report atomically, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, report)


def publish_report(path: Path, report: dict[str, Any], print_table: Callable[[dict[str, Any]], None]) -> None:
    """Print the report's table, write the JSON report to `path` and say where."""
    print_table(report)
    write_report(path, report)
    print(f"wrote {path}")


def machine_summary() -> dict[str, Any]:
    """The machine and its load when the benchmark starts (each benchmark adds what else it depends on)."""
    return {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
    }


def proc_status_kib(field_name: str, pid: int | str = "self") -> int:
    """A kB field of Linux's `/proc/<pid>/status` (`VmRSS`: resident memory, `VmHWM`: its peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/{pid}/status")


def search_group(pattern: str, text: str, flags: int = 0) -> str:
    """The first group of `pattern`'s first match in `text` (a page's token, a /proc field); an error if none."""
    match = re.search(pattern, text, flags)
    if match is None:
        raise ValueError(f"nothing matches {pattern!r}")
    return match.group(1)


@contextlib.contextmanager
def timed_stage(stage_seconds: dict[str, float], name: str) -> Iterator[None]:
    """Announce a stage of the run and record its wall time in `stage_seconds`."""
    print(f"{name} ...", flush=True)
    start = time.perf_counter()
    yield
    stage_seconds[name] = round(time.perf_counter() - start, 2)


def fmt(value: float | None, spec: str = ",.0f") -> str:
    """A table cell: `value` formatted, or "n/a" when it was not measured."""
    return "n/a" if value is None else format(value, spec)


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def format_rows(rows: Sequence[Sequence[object]], separator: str = "  ") -> str:
    """Rows as left-aligned columns, the first row a header underlined with dashes."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[column]) for row in cells) for column in range(len(cells[0]))]
    rule = "-+-" if separator.strip() else separator
    lines = []
    for index, row in enumerate(cells):
        lines.append(separator.join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if index == 0:
            lines.append(rule.join("-" * width for width in widths))
    return "\n".join(lines)
