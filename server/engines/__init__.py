"""Inference engines behind `/v1/chat/completions` and `/v1/completions` (`ZAYA_ENGINE` picks one).

`local` (`server.engines.local`) runs `zaya_model` in process on CPU; `vllm` (`server.engines.vllm`) drives vLLM's
async engine. Both implement `server.engines.base.Engine`.
"""

from __future__ import annotations

import importlib

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
