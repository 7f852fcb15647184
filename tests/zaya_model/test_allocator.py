"""`keep_freed_memory`: a freed large tensor's memory stays in the process for reuse until released."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocates and touches 256 MiB, frees it, and reports how much of it left the process (resident KiB), then how
# much more left after `release_freed_memory`.
PROBE = """
import sys, torch
from zaya_model.training.allocator import keep_freed_memory, release_freed_memory
def rss_kib():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
block = torch.ones(64 * 2**20)
held = rss_kib()
del block
freed = rss_kib()
release_freed_memory()
print(applied, held - freed, freed - rss_kib())
"""


def probe(mode: str) -> tuple[str, int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    applied, released_on_free, released_on_request = out.split()
    return applied, int(released_on_free), int(released_on_request)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc are Linux-only")
def test_freed_memory_stays_in_the_process_until_released():
    _, released_by_default, _ = probe("default")
    applied, released_when_kept, released_on_request = probe("keep")
    assert released_by_default > 200 * 1024  # glibc unmaps a freed 256 MiB block at once
    assert applied == "True"
    assert released_when_kept < 16 * 1024  # kept for the next allocation...
    assert released_on_request > 200 * 1024  # ...until `release_freed_memory` (a worker between jobs)
