"""Keeping freed memory inside a training process.

A training step frees and re-allocates the same large buffers (activations, gradients, tens of MB each) on every step.
glibc serves blocks that large with `mmap` and unmaps them on free, so every step faults hundreds of MB of fresh, zeroed
pages in again, a sizeable share of a fine-tuning step on a small CPU. With `mmap` off for allocations and the heap
never trimmed, freed blocks are reused instead. The peak is unchanged; the process just stays at it between steps, until
`release_freed_memory` hands it back (a worker, between jobs).
"""

from __future__ import annotations

import ctypes
import sys

# glibc's mallopt(3) parameters.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1  # the largest value the int parameter takes: bytes free at the heap's top before trimming


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # another C library (musl) or none by that name
        return None


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse, process-wide; for processes whose job is training (the
    `zaya pretrain` / `zaya finetune` commands, the job worker). Returns False where the C library is not glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))


def release_freed_memory() -> None:
    """Hand the memory kept so far back to the system (between jobs: a worker need not hold its last job's peak)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
