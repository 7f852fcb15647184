"""`keep_freed_memory`: a freed large tensor's memory stays in the process for the next step to reuse."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocates and touches 256 MiB, frees it, and reports how much of it left the process (resident KiB).
PROBE = """
import sys, torch
from zaya_model.training.allocator import keep_freed_memory
def rss_kib():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
block = torch.ones(64 * 2**20)
held = rss_kib()
del block
print(applied, held - rss_kib())
"""


def released_kib(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    applied, released = out.split()
    return applied, int(released)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc are Linux-only")
def test_freed_memory_stays_in_the_process_for_reuse():
    _, released_by_default = released_kib("default")
    applied, released_when_kept = released_kib("keep")
    assert released_by_default > 200 * 1024  # glibc unmaps a freed 256 MiB block at once
    assert applied == "True"
    assert released_when_kept < 16 * 1024  # kept for the next allocation
