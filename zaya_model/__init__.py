"""ZAYA1 as a HuggingFace model: `ZayaConfig`, `ZayaModel`, `ZayaForCausalLM`."""

from .cache_zaya import ZayaCache
from .configuration_zaya import ZayaConfig
from .modeling_zaya import ZayaForCausalLM, ZayaModel, ZayaPreTrainedModel, count_parameters

__all__ = ["ZayaCache", "ZayaConfig", "ZayaForCausalLM", "ZayaModel", "ZayaPreTrainedModel", "count_parameters"]
