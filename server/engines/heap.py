"""Keep Python's cyclic garbage collector off a serving process's startup heap.

Once imports (torch, transformers, vLLM) are done and an engine has started, the API server holds hundreds of
thousands of objects the collector tracks, and every full collection walks them all: under streaming load, a long
pause in every stream. Freezing the heap then (`gc.freeze`, as vLLM's own server does after its start) takes those
objects out of the collector's generations, so a full collection afterwards walks only what came later.
"""

from __future__ import annotations

import functools
import gc


def freeze_heap() -> None:
    """Collect what is garbage now, then freeze everything left."""
    gc.collect()
    gc.freeze()


# The inference service's, once its engine started: once per process, since a collection there is slow and a test
# process starts many apps.
freeze_startup_heap = functools.cache(freeze_heap)
