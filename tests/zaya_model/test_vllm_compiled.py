"""The plugin's default path: without LoRA, vLLM compiles `ZayaModel` (dynamo + inductor on CPU) around our custom
op for the CCA state. Its greedy tokens must equal `zaya_model`'s `generate()` like the eager path's.

Its experts run in vLLM's fused CPU kernel, inside the compiled graph (test_vllm_plugin covers our own dispatch)."""

import os

import pytest
from vllm_helpers import (
    ENGINE_ENV,
    assert_same_generations,
    build_checkpoint,
    hf_greedy,
    random_prompts,
    vllm_greedy,
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = tmp_path_factory.mktemp("zaya_vllm_compiled")
    model = build_checkpoint(path)
    previous = {key: os.environ.get(key) for key in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)
    from vllm import LLM
    from vllm.config import CompilationMode

    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=32,  # long prompts continue from their saved CCA state across chunks
        seed=0,
    )
    assert llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
    yield llm, model
    llm.llm_engine.engine_core.shutdown()
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_compiled_model_matches_hf_generate(compiled):
    llm, model = compiled
    # Batches of 1..6 sequences mixing decodes and prefill chunks: each a new dynamic shape for the graph.
    prompts = random_prompts([1, 2, 5, 11, 23, 45], model.config.vocab_size, seed=11)
    expected = [hf_greedy(model, prompt, 24) for prompt in prompts]
    assert_same_generations(vllm_greedy(llm, prompts, 24), expected)
