"""Which cores a vLLM engine computes on when it runs on the CPU, and which stay with the serving process.

vLLM's engine core computes with one OpenMP thread per core it may use, and those threads spin at every barrier
while one of them is preempted. When the API server (HTTP, SSE, database rows) shares those cores, every
millisecond it takes costs the engine more than that; and the scheduler tends to wake the server's threads on the
core whose engine thread just woke them. vLLM's own CPU executor therefore reserves a core for its front end and
binds the model's threads to the rest. Our engine runs the model in the engine-core process (`engine_core_executor`)
where that binding does not happen, so it is done here when cores are reserved (`ZAYA_VLLM_CPU_RESERVED_CORES`):
the engine core is started on the compute cores with one OpenMP thread each, and this process's threads keep to the
reserved cores while an engine is up.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuPlacement:
    front_end: frozenset[int]  # cores for this process's own threads (the API server, its clients' connections)
    compute: frozenset[int]  # cores for the engine core's OpenMP threads

    @classmethod
    def reserving(cls, reserved: int) -> CpuPlacement | None:
        """The lowest `reserved` of the cores this process may use for the front end, the rest for compute; None
        when nothing is reserved or too few cores are left to split (everything then shares every core)."""
        if reserved <= 0:
            return None
        cores = sorted(os.sched_getaffinity(0))  # Linux only, as is pinning
        if len(cores) <= reserved:
            return None
        return cls(frozenset(cores[:reserved]), frozenset(cores[reserved:]))

    @contextlib.contextmanager
    def starting_engine_core(self) -> Iterator[None]:
        """Processes started within (vLLM spawns its engine core) run on the compute cores with one OpenMP thread
        per core; afterwards every thread of this process keeps to the front-end cores.

        A spawned child inherits the affinity of the thread that starts it and reads `OMP_NUM_THREADS` when it
        starts; both are set only for the duration (as vLLM's own CPU executor sets its workers' variables)."""
        previous_threads = os.environ.get("OMP_NUM_THREADS")
        previous_mask = os.sched_getaffinity(0)
        os.environ["OMP_NUM_THREADS"] = str(len(self.compute))
        os.sched_setaffinity(0, self.compute)  # this thread only: what the engine core inherits
        try:
            yield
        finally:
            if previous_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = previous_threads
            os.sched_setaffinity(0, previous_mask)
        pin_process(self.front_end)

    def release(self) -> None:
        """Every thread of this process back onto all the cores it was split from."""
        pin_process(self.front_end | self.compute)


def pin_process(cores: frozenset[int] | set[int], pid: int | str = "self") -> None:
    """Every thread of process `pid` (this one by default) onto `cores` (threads started later inherit their
    starter's cores)."""
    for thread_id in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(thread_id), cores)
