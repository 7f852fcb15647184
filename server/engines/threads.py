"""Where torch work runs in a serving process, so that it does not slow down every later op.

torch's OpenMP runtime (libgomp) gives each thread that runs a parallel op a pool of worker threads, kept until
that thread exits. Once the process holds more pool threads than cores, libgomp's workers stop spin-waiting
between parallel regions, and every op then waits for them to wake up: a small model's batch-1 decode step slows
markedly once a second thread, even an idle one, has run torch ops.
So the local engine runs its forward passes on one compute thread, and other torch work in a serving process
(loading weights, bootstrapping a model before the server starts) runs on a thread that ends with that work.
The event loop's thread runs none; neither do executor threads, which outlive their work.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")

THREAD_NAME_PREFIX = "zaya-torch-task"


def run_on_own_thread(function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`function(*args, **kwargs)` on a new thread that has ended when this returns."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME_PREFIX) as pool:
        return pool.submit(function, *args, **kwargs).result()


async def on_own_thread(function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`run_on_own_thread` for the event loop: awaits the result without blocking the loop."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME_PREFIX)
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(function, *args, **kwargs))
    finally:
        pool.shutdown(wait=False)  # the thread ends once `function` returns, even if this await was cancelled
