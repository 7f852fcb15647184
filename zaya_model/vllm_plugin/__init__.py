"""ZAYA1 for vLLM, as an out-of-tree model plugin.

`register()` is the `vllm.general_plugins` entry point (see pyproject.toml). vLLM calls it in every process it
starts (API server, engine core, workers), so it is also the place for per-process fixes.
"""

ARCHITECTURE = "ZayaForCausalLM"


def register() -> None:
    """Register our `ZayaForCausalLM` with vLLM unless this vLLM ships its own ZAYA model."""
    import torch
    from vllm import ModelRegistry

    # vLLM's bf16 AMX kernels run before the process asks Linux for AMX permission (SIGILL): ask first.
    if hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from .cpu_lora import fix_cpu_lora_slot_indexing
        from .cpu_seeds import fix_cpu_seeded_partial_prefill

        fix_cpu_lora_slot_indexing()
        fix_cpu_seeded_partial_prefill()
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP

        from .config_hook import ZayaConfigHook

        ModelRegistry.register_model(ARCHITECTURE, "zaya_model.vllm_plugin.model:ZayaForCausalLM")
        MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, ZayaConfigHook)
