"""Tiny random ZAYA models for tests: small enough to run in milliseconds, random enough to catch bugs."""

import torch

from zaya_model import ZayaConfig, ZayaForCausalLM

TINY_ZAYA = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=4,
    router_hidden_size=32,
    max_position_embeddings=512,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def randomize_zaya(model, seed: int = 0, scale: float = 0.1):
    """Perturb every parameter and the balancing biases so no init symmetry hides a bug.

    The skip class's bias stays at -1: stock transformers resets it to -1 on every load.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
        for layer in model.model.layers:
            biases = layer.mlp.gate.balancing_biases
            biases[:-1] = torch.randn(biases.numel() - 1, generator=generator) * 0.05
            biases[-1] = -1.0
    return model


def skip_prone_model(calibration_ids: torch.Tensor, **overrides) -> ZayaForCausalLM:
    """A tiny model whose routers pick the skip class for about half of `calibration_ids`' tokens (so both branches
    run): each skip bias is set to the median margin by which an expert wins."""
    torch.manual_seed(0)
    model = randomize_zaya(ZayaForCausalLM(ZayaConfig(**{**TINY_ZAYA, **overrides}))).eval()
    margins = {}

    def record(router, _inputs, outputs):
        probs = torch.softmax(outputs[0].float(), dim=-1).reshape(-1, router.num_experts + 1)
        best_expert = (probs[:, :-1] + router.balancing_biases[:-1]).max(dim=-1).values
        margins[router] = (best_expert - probs[:, -1]).median()

    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in model.model.layers]
    with torch.no_grad():
        model(calibration_ids)
    for hook in hooks:
        hook.remove()
    for router, margin in margins.items():
        router.balancing_biases[-1] = margin
    return model
