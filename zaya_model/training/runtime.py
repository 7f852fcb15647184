"""Process settings for a process whose job is training (`zaya pretrain`, `zaya finetune`, the job worker).

- Freed memory is kept for reuse (`allocator.keep_freed_memory`): a step frees and re-allocates the same large
  buffers, which glibc would otherwise unmap and fault in again every step.
- Subnormal floats are flushed to zero. A CPU computes with subnormal operands (below ~1.2e-38 in fp32) many times
  slower than with normal ones, and training makes them: the log-softmax backward multiplies by `exp(log p)` for every
  vocabulary entry, and probabilities far below 1e-38 are common. That backward then runs many times slower, and the
  step's matmuls slow down too. Flushing them changes no result a model can tell apart (GPUs flush them in most
  kernels).
"""

from __future__ import annotations

import torch

from .allocator import keep_freed_memory


def prepare_training_process() -> dict[str, bool]:
    """Apply both settings; returns which ones took effect.

    Call it first, before torch computes anything: the flush is a per-thread CPU flag, which torch's OpenMP
    worker threads copy from the thread that starts them when they start (on the first parallel operation).
    Called later, workers already running keep computing with subnormals, and stay slow.
    """
    return {"keeps_freed_memory": keep_freed_memory(), "flushes_subnormals": bool(torch.set_flush_denormal(True))}
