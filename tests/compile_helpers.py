"""Compiled layers in tests: what `enable_compiled_layers` did (calls of the compiled block parts, graphs dynamo
holds for them), and a host without a C++ compiler.

The counts are per process; under pytest-xdist another test in the same worker may have compiled the same graphs
already, so tests compare counts before and after, or ask only that graphs exist.
"""

import contextlib

from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from zaya_model.cpu.compiled_layers import attention_and_routing, compiled_function, merge_experts


def compiled_calls() -> int:
    """Times a layer ran a compiled part (it fetches the part's compiled wrapper on every call)."""
    info = compiled_function.cache_info()
    return info.hits + info.misses


def compiled_graphs() -> int:
    """Graphs dynamo holds for the two block parts (one per shape, mode and layer kind)."""
    return sum(len(_debug_get_cache_entry_list(f.__code__)) for f in (attention_and_routing, merge_experts))


@contextlib.contextmanager
def no_cpp_compiler(monkeypatch):
    """Make torch.compile's CPU backend find no C++ compiler (as on a slim image without g++)."""
    import torch._inductor.config

    monkeypatch.delenv("CXX", raising=False)
    with torch._inductor.config.patch({"cpp.cxx": ("no-such-c++-compiler",)}):
        yield
