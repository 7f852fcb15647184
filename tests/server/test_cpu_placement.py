"""Cores for a CPU vLLM engine: its engine core computes on its own, the serving process keeps to the rest."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

from server.engines.cpu_placement import CpuPlacement

CORES = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two usable cores to split")


def thread_cores() -> list[set[int]]:
    cores = []
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            cores.append(os.sched_getaffinity(int(thread)))
    return cores


def test_nothing_is_reserved_when_asked_for_none_or_when_no_core_would_be_left():
    assert CpuPlacement.reserving(0) is None
    assert CpuPlacement.reserving(len(CORES)) is None


@needs_two_cores
def test_the_lowest_cores_are_reserved_and_the_rest_compute():
    placement = CpuPlacement.reserving(1)
    assert placement.front_end == {CORES[0]}
    assert placement.compute == set(CORES[1:])


@needs_two_cores
def test_a_process_started_within_computes_on_the_compute_cores_and_this_process_keeps_to_the_front_end():
    placement = CpuPlacement.reserving(1)
    threads_before = os.environ.get("OMP_NUM_THREADS")
    probe = "import json, os; print(json.dumps([sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS']]))"
    try:
        with placement.starting_engine_core():
            child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        child_cores, child_threads = json.loads(child.stdout)
        assert set(child_cores) == placement.compute
        assert child_threads == str(len(placement.compute))  # one OpenMP thread per compute core
        assert os.environ.get("OMP_NUM_THREADS") == threads_before
        assert all(cores == placement.front_end for cores in thread_cores())
    finally:
        placement.release()
    assert all(cores == set(CORES) for cores in thread_cores())
