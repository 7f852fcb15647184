"""vLLM config checks for ZAYA1, run by vLLM before the engine is built (registered in `MODELS_CONFIG_MAP`)."""

import logging

from vllm.model_executor.models.config import VerifyAndUpdateConfig

logger = logging.getLogger(__name__)


class ZayaConfigHook(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        # vLLM turns prefix caching on for hybrid models by default ("align" mode), which needs the CCA state
        # saved at every KV block boundary. The plugin keeps one state per request, so a prefix-cache hit would
        # resume from the wrong state: turn it off instead of serving wrong tokens.
        cache_config = vllm_config.cache_config
        if cache_config.enable_prefix_caching:
            logger.warning("ZAYA: prefix caching is not supported by the CCA state layer; disabling it.")
            cache_config.enable_prefix_caching = False
