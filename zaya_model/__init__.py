"""ZAYA1 as a HuggingFace model: `ZayaConfig`, `ZayaModel`, `ZayaForCausalLM`.

Names are imported on first use, so importing a light submodule (a CLI, the corpus reader) does not pay for torch
and transformers.
"""

from importlib import import_module
from typing import TYPE_CHECKING

_EXPORTS = {
    "ZayaCache": ".cache_zaya",
    "ZayaConfig": ".configuration_zaya",
    "ZayaForCausalLM": ".modeling_zaya",
    "ZayaModel": ".modeling_zaya",
    "ZayaPreTrainedModel": ".modeling_zaya",
    "count_parameters": ".modeling_zaya",
}

__all__ = ["ZayaCache", "ZayaConfig", "ZayaForCausalLM", "ZayaModel", "ZayaPreTrainedModel", "count_parameters"]

if TYPE_CHECKING:
    from .cache_zaya import ZayaCache
    from .configuration_zaya import ZayaConfig
    from .modeling_zaya import ZayaForCausalLM, ZayaModel, ZayaPreTrainedModel, count_parameters


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
