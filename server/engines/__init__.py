"""Inference engines behind `/v1/chat/completions` and `/v1/completions` (`ZAYA_ENGINE` picks one).

`local` (`server.engines.local`) runs `zaya_model` in process on CPU. `vllm` plugs in here: a module
`server.engines.vllm` exposing `VLLMEngine`, an `Engine` (see `server.engines.base`) driving vLLM's async engine.
"""

from __future__ import annotations

import importlib

from server.engines.base import Engine, EngineError

ENGINE_CLASSES = {"local": "server.engines.local:LocalEngine", "vllm": "server.engines.vllm:VLLMEngine"}


def create_engine(kind: str) -> Engine:
    module_name, _, class_name = ENGINE_CLASSES[kind].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise EngineError(f"The '{kind}' engine is not available in this installation ({error}).") from error
    return getattr(module, class_name)()
