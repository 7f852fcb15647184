"""vLLM config checks for ZAYA1, run by vLLM before the engine is built (registered in `MODELS_CONFIG_MAP`)."""

from vllm.model_executor.models.config import MambaModelConfig


class ZayaConfigHook(MambaModelConfig):
    """As for vLLM's own hybrid models: with prefix caching on, the CCA state is kept at every KV block boundary
    ("align" mode, one state block per KV block), so a request whose prompt starts with cached blocks resumes from
    the state saved at the last of them."""
