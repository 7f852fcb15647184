"""A grouped linear layer for top-1 MoE experts: rows sorted by expert, one matmul per expert.

`F.grouped_mm` is the right tool on GPUs. On CPU (torch 2.13) it runs well below a plain matmul's speed, and
indexing `weight[e]` per expert under autograd materialises a full-size weight gradient per expert. This function
issues one BLAS matmul per non-empty group in both passes and writes each expert's weight gradient into one shared
buffer, so it runs at plain-matmul speed. The loop is over experts, never over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Up to this many rows `weight @ inputs^T` reads an expert's weight faster than `inputs @ weight^T` (MKL's
# transposed path), as for the few rows per expert of a short prompt's prefill.
FEW_ROWS = 16
# CPU matmuls in bf16/fp16 run in oneDNN, which compiles a kernel for each new shape (costing far more than
# the matmul) and caches it. Group sizes change every step, so larger groups are padded to a multiple of this many
# rows: the shapes then repeat and hit the cache.
LOW_PRECISION_ROW_MULTIPLE = 32


def group_row_multiple(dtype: torch.dtype, device: torch.device) -> int:
    """Rows a group is padded to a multiple of for matmuls in `dtype` on `device`: 1 (no padding) but for CPU
    matmuls in a low-precision dtype, as under CPU bf16 autocast."""
    if device.type != "cpu":
        return 1
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
    return LOW_PRECISION_ROW_MULTIPLE if dtype in (torch.bfloat16, torch.float16) else 1


def group_layout(group_index: torch.Tensor, num_groups: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows for tokens grouped by `group_index` [tokens]: group g's rows are contiguous, in token order, groups in
    order. With `multiple` > 1 a group of more than `FEW_ROWS` tokens is padded to a multiple of it (the padding
    rows, between groups, are for the caller to zero). Returns each token's row and each group's row count."""
    group_sizes = torch.bincount(group_index, minlength=num_groups)
    order = torch.argsort(group_index, stable=True)
    positions = torch.arange(len(order), device=order.device)
    if multiple == 1:
        return torch.empty_like(order).index_copy_(0, order, positions), group_sizes
    rounded = (group_sizes + multiple - 1) // multiple * multiple
    padded_sizes = torch.where(group_sizes <= FEW_ROWS, group_sizes, rounded)
    # How far each group's first row moves: the padding of the groups before it.
    offsets = torch.cumsum(padded_sizes - group_sizes, dim=0) - (padded_sizes - group_sizes)
    sorted_rows = positions + offsets.index_select(0, group_index.index_select(0, order))
    return torch.empty_like(order).index_copy_(0, order, sorted_rows), padded_sizes


def _spans(group_sizes: list[int]):
    start = 0
    for group, size in enumerate(group_sizes):
        if size:
            yield group, start, start + size
        start += size


def _routed_weights(weight: torch.Tensor, groups: list[int], cast: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each routed group's weight: its cast copy where there are cast copies, else its slice of `weight`."""
    return dict(zip(groups, cast, strict=True)) if cast else {group: weight[group] for group in groups}


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, inputs: torch.Tensor, weight: torch.Tensor, group_sizes: list[int], dtype: torch.dtype | None
    ) -> torch.Tensor:
        # Under autocast (`dtype`) only the experts that got tokens are cast, one at a time: casting the whole
        # stack, and its gradient back, moved every expert's weights twice per step whatever the routing.
        groups = [group for group, _, _ in _spans(group_sizes)]
        cast = [weight[group].to(dtype) for group in groups] if dtype is not None else []
        ctx.save_for_backward(inputs, weight, *cast)  # saved, not kept on ctx: checkpointing must see them
        ctx.group_sizes = group_sizes
        weights = _routed_weights(weight, groups, cast)
        output = inputs.new_empty(inputs.shape[0], weight.shape[1])
        for group, start, end in _spans(group_sizes):
            if end - start <= FEW_ROWS:
                output[start:end] = torch.mm(weights[group], inputs[start:end].t()).t()
            else:
                torch.mm(inputs[start:end], weights[group].t(), out=output[start:end])
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        inputs, weight, *cast = ctx.saved_tensors
        weights = _routed_weights(weight, [group for group, _, _ in _spans(ctx.group_sizes)], cast)
        grad_inputs = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_inputs = torch.empty_like(inputs)  # every row belongs to exactly one group
            for group, start, end in _spans(ctx.group_sizes):
                torch.mm(grad_output[start:end], weights[group], out=grad_inputs[start:end])
        if ctx.needs_input_grad[1]:
            grad_weight = torch.empty_like(weight)
            for group, size in enumerate(ctx.group_sizes):
                if not size:
                    grad_weight[group].zero_()  # an expert that got no tokens gets no gradient
            for group, start, end in _spans(ctx.group_sizes):
                if grad_weight.dtype == grad_output.dtype:
                    torch.mm(grad_output[start:end].t(), inputs[start:end], out=grad_weight[group])
                else:  # autocast: the gradient in the weight's dtype, as casting the product back would give
                    grad_weight[group].copy_(torch.mm(grad_output[start:end].t(), inputs[start:end]))
        return grad_inputs, grad_weight, None, None


def grouped_linear(inputs: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """`inputs` [tokens, in] sorted by group, `weight` [groups, out, in], `group_sizes` [groups] -> [tokens, out]."""
    if inputs.device.type != "cpu":
        offsets = torch.cumsum(group_sizes, dim=0, dtype=torch.int32)
        return F.grouped_mm(inputs, weight.transpose(1, 2), offs=offsets)
    if torch.is_autocast_enabled("cpu"):
        # Run in the autocast dtype, as a built-in matmul would; the Function itself sees plain tensors.
        dtype = torch.get_autocast_dtype("cpu")
        with torch.autocast("cpu", enabled=False):
            return _GroupedLinear.apply(inputs.to(dtype), weight, group_sizes.tolist(), dtype)
    return _GroupedLinear.apply(inputs, weight, group_sizes.tolist(), None)
