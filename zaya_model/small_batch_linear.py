"""Linear layers for the few-row matmuls of CPU decoding.

A decode step multiplies one row (or a handful) by every weight, so it is bound by reading weights from memory. On
CPU, `F.linear` hands such a matmul to MKL with the [out, in] weight transposed, a path that reads weights at about
half of what memory delivers and, for 2-64 rows, slower still. Computing `weight @ inputs^T` instead, with the
weight's output rows split into one block per thread and the blocks issued as one batched matmul so that every
thread reads its own block, measured 1.5-2.5x faster on a 2-core EPYC for 1-64 rows of ZAYA1's weight shapes with
the weights coming from memory, as in decoding. Larger inputs (prefill), training (anything with autograd on) and
other devices keep `F.linear`.

MKL's result for the split matmul depends on the weight's address modulo 16 bytes, so the path only takes weights
aligned to 64 bytes (its results are then reproducible); `align_parameters` gives a model loaded from a
memory-mapped checkpoint (safetensors offsets are only element-aligned) aligned copies of its weights.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows the split batched matmul beat `F.linear` on every weight shape of ZAYA1 we measured.
MAX_SMALL_BATCH_ROWS = 64
ALIGNMENT_BYTES = 64


_traced_for_inductor = False


@contextlib.contextmanager
def traced_for_inductor():
    """`linear` as under `torch.compile`, for a graph traced without dynamo that inductor then compiles
    (`zaya_model.decode_step`)."""
    global _traced_for_inductor
    previous, _traced_for_inductor = _traced_for_inductor, True
    try:
        yield
    finally:
        _traced_for_inductor = previous


def _for_inductor() -> bool:
    return _traced_for_inductor or torch.compiler.is_compiling()


@torch.compiler.assume_constant_result
def _num_threads() -> int:
    return torch.get_num_threads()


def linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, with the weight read by every CPU thread when `inputs` has only a few rows."""
    out_features, in_features = weight.shape
    rows = inputs.numel() // in_features if in_features else 0
    blocks = _num_threads()
    compiled = _for_inductor()
    if compiled and out_features % blocks:
        blocks = 1  # one block is as good to inductor's loops, and beats `F.linear`'s library call
    if (
        inputs.device.type != "cpu"
        or not 0 < rows <= MAX_SMALL_BATCH_ROWS
        or out_features % blocks
        or torch.is_grad_enabled()
        or not weight.is_contiguous()
        # Compiled, inductor writes its own loops for the product (alignment does not matter there).
        or (not compiled and weight.data_ptr() % ALIGNMENT_BYTES)
        or torch.is_autocast_enabled("cpu")
    ):
        return F.linear(inputs, weight, bias)
    block_weight = weight.view(blocks, out_features // blocks, in_features)
    columns = inputs.reshape(rows, in_features).t().expand(blocks, in_features, rows)
    if bias is None or compiled:
        # Compiled, a plain `bmm` (not `baddbmm`) becomes a fused loop with the bias add instead of a library call.
        blocked = torch.bmm(block_weight, columns)
        if bias is not None:
            blocked = blocked + bias.view(blocks, out_features // blocks, 1)
    else:
        blocked = torch.baddbmm(bias.view(blocks, out_features // blocks, 1), block_weight, columns)
    # [blocks, out / blocks, rows] -> [rows, out]: a view for one row, a small copy otherwise.
    return blocked.permute(2, 0, 1).reshape(*inputs.shape[:-1], out_features)


@torch.no_grad()
def align_parameters(module: nn.Module) -> None:
    """If any CPU parameter is not aligned to `ALIGNMENT_BYTES`, give every CPU parameter and buffer its own copy.

    All of them, not only the misaligned ones: a single tensor left in a memory-mapped checkpoint keeps the whole
    mapping, and with it every page the copies read, resident (1.8x the model's size in RSS). Tied parameters are
    one `Parameter` object, so they stay tied.
    """
    if all(p.device.type != "cpu" or p.data_ptr() % ALIGNMENT_BYTES == 0 for p in module.parameters()):
        return
    for parameter in module.parameters():
        if parameter.device.type == "cpu":
            parameter.data = parameter.data.clone()
    # New buffer objects (a buffer's old object may be held elsewhere, as the loader does); shared ones stay shared.
    copies: dict[int, torch.Tensor] = {}
    for owner in module.modules():
        for name, buffer in owner._buffers.items():
            if buffer is not None and buffer.device.type == "cpu":
                if id(buffer) not in copies:
                    copies[id(buffer)] = buffer.clone()
                owner._buffers[name] = copies[id(buffer)]


class SmallBatchLinear(nn.Linear):
    """`nn.Linear` (same parameters, state dict and PEFT support) whose forward uses `linear` above."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return linear(inputs, self.weight, self.bias)
