"""The balancing-bias hook: counts are gathered in training forwards and the update evens out expert load."""

import torch
from tiny_models import TINY_ZAYA, randomize_zaya

from zaya_model import ZayaConfig, ZayaForCausalLM
from zaya_model.training.balancing import BalancingBiasUpdater


def test_bias_update_evens_out_a_skewed_router():
    torch.manual_seed(0)
    # Token-dependent router preferences (as a trained router has), then a strong skew towards expert 0.
    model = randomize_zaya(ZayaForCausalLM(ZayaConfig(**TINY_ZAYA)), scale=0.3).train()
    for layer in model.model.layers:
        layer.mlp.gate.balancing_biases[0] = 0.5
    updater = BalancingBiasUpdater(model, lr=1e-2)
    input_ids = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(1))

    with torch.no_grad():
        model(input_ids, use_cache=False)
    first = updater.step()
    assert len(first["expert_load"]) == TINY_ZAYA["num_hidden_layers"]
    totals = [sum(load) + skip for load, skip in zip(first["expert_load"], first["skip_rate"], strict=True)]
    assert all(abs(total - 1.0) < 1e-6 for total in totals)
    first_imbalance = sum(first["load_imbalance"]) / len(first["load_imbalance"])
    assert first_imbalance > 3.0  # most tokens on expert 0 (4 experts: uniform load = 1.0)

    late = []
    for step in range(100):
        with torch.no_grad():
            model(input_ids, use_cache=False)
        stats = updater.step()
        if step >= 90:
            late.append(sum(stats["load_imbalance"]) / len(stats["load_imbalance"]))
    assert sum(late) / len(late) < 0.6 * first_imbalance
    for layer in model.model.layers:
        biases = layer.mlp.gate.balancing_biases
        assert biases[0] < 0.5  # the over-used expert was pushed down
        assert biases[-1] == -1.0  # skip class untouched by default


def test_eval_forwards_do_not_count():
    torch.manual_seed(0)
    model = ZayaForCausalLM(ZayaConfig(**TINY_ZAYA)).eval()
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 8)))
    assert all(layer.mlp.gate.routed_token_counts is None for layer in model.model.layers)
