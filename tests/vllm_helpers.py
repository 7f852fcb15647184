"""Shared by the vLLM tests: a tiny ZAYA checkpoint vLLM can serve, LoRA adapters, and `generate()` references.

Failures with vLLM are silent (a wrong CCA state or adapter slot only shows as different tokens), so every test
compares whole token sequences with `zaya_model`'s `generate()`.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY_ZAYA

from zaya_model import ZayaConfig, ZayaForCausalLM
from zaya_model.pretrain.tokenizer import train_tokenizer

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "o_proj"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "compressed convolutional attention keeps a small state per sequence",
    "mixture of experts routes every token to one expert or to none",
    "serving many requests at once needs paged caches and careful state slots",
] * 20


def build_checkpoint(path, moe_intermediate_size: int = 32) -> ZayaForCausalLM:
    """A tiny ZAYA (with a chat-template tokenizer) with every learned scale and bias perturbed, so each code path
    changes the output; saved to `path`. The returned model's generation config does not stop at end of sequence.

    Expert widths that are multiples of 32 run in vLLM's fused CPU experts kernel; others in our own dispatch."""
    tokenizer = train_tokenizer(CORPUS, vocab_size=320)
    config = ZayaConfig(
        **{
            **TINY_ZAYA,
            "head_dim": 32,  # vllm-cpu attention kernels start at 32
            "moe_intermediate_size": moe_intermediate_size,
            "router_hidden_size": 16,
            "cca_time0": 2,
            "cca_time1": 3,  # different kernel sizes catch a swapped convolution
            "skip_expert_mode": "scaled_input",
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        }
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


def build_adapter(
    checkpoint,
    path,
    seed: int,
    *,
    experts: bool = False,
    targets: list[str] = ATTENTION_MODULES,
    token_rows: list[int] | None = None,
):
    """A random PEFT LoRA on the attention projections `targets` (and the fused experts if `experts`, and the
    embedding rows `token_rows`, tied to the LM head, as fine-tuning trains the chat template's tokens), saved to
    `path`; returns the HF+PEFT model (not stopping at end of sequence)."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=targets,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else None,
        trainable_token_indices={"embed_tokens": token_rows} if token_rows else None,
        init_lora_weights=False,
    )
    model = peft.get_peft_model(ZayaForCausalLM.from_pretrained(checkpoint).eval(), config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(std=0.3)
            elif "trainable_tokens_delta" in name:
                parameter.normal_(std=0.5)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return model


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Ids from 5 up: not special tokens.
    return [torch.randint(5, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def hf_greedy(model, prompt: list[int], max_tokens: int, **generate_kwargs) -> tuple[list[int], list[float]]:
    """Greedy tokens and each one's log-probability, from `zaya_model`'s `generate()`."""
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **generate_kwargs,
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
