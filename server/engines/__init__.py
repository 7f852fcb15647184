"""Inference engines behind `/v1/chat/completions` and `/v1/completions` (`ZAYA_ENGINE` picks one).

`local` (`server.engines.local`) runs `zaya_model` in process on CPU; `vllm` (`server.engines.vllm`) drives vLLM's
async engine. Both implement `server.engines.base.Engine`.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from server.engines.base import Engine, EngineError
from server.settings import Settings

# engine kind -> its class and the section of `Settings` it is built from
ENGINES = {
    "local": ("server.engines.local:LocalEngine", "local_engine"),
    "vllm": ("server.engines.vllm:VLLMEngine", "vllm"),
}


def create_engine(settings: Settings) -> Engine:
    """The engine `settings.engine` names, configured by its section of `settings`."""
    path, section = ENGINES[settings.engine]
    module_name, _, class_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise EngineError(f"The '{settings.engine}' engine is not available in this installation ({error}).") from error
    engine: Engine = getattr(module, class_name)(getattr(settings, section))  # a class ENGINES names
    return engine


def serving_problems(settings: Settings, checkpoint: Path) -> list[str]:
    """What the engine `settings.engine` names cannot run of a full checkpoint, one sentence each (empty: it can).

    Asked when a checkpoint is registered: vLLM would otherwise accept a shape its kernels do not take and die on
    the first request (`zaya_model.vllm_plugin.support`). The local engine runs any ZAYA shape.
    """
    if settings.engine != "vllm":
        return []
    try:
        from zaya_model.vllm_plugin.support import unsupported_features
    except ImportError as error:
        return [f"vLLM does not import in {sys.prefix} ({error}): run with the vLLM environment (make install-vllm)"]
    from zaya_model import ZayaConfig

    return unsupported_features(ZayaConfig.from_pretrained(checkpoint), settings.vllm.dtype)
