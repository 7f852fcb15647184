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


def counts(model):
    return [layer.mlp.gate.routed_token_counts for layer in model.model.layers]


def test_the_updater_counts_real_tokens_of_training_forwards_once():
    torch.manual_seed(0)
    model = ZayaForCausalLM(ZayaConfig(**TINY_ZAYA)).eval()
    input_ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    model.train()(input_ids)
    assert all(c is None for c in counts(model))  # nothing counts before an updater hooks the model

    updater = BalancingBiasUpdater(model)
    assert BalancingBiasUpdater(model).counter is updater.counter  # a second updater does not count twice
    with torch.no_grad():
        model.eval()(input_ids)
    assert all(c is None for c in counts(model))  # evaluation does not count

    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :5] = 0  # left padding: 16 - 5 real tokens
    model.train()(input_ids, attention_mask=attention_mask, use_cache=False)
    first = [c.clone() for c in counts(model)]
    assert all(c.shape == (TINY_ZAYA["num_experts"] + 1,) and c.sum() == 11 for c in first)
    # Reentrant gradient checkpointing reruns each layer, hooks and all, in the backward pass: not counted again.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model(input_ids, labels=input_ids, use_cache=False).loss.backward()
    assert all(c.sum() == 11 + 16 for c in counts(model))
    updater.step()
    assert all(c is None for c in counts(model))  # consumed by the update

    updater.counter.remove()
    model(input_ids, use_cache=False)
    assert all(c is None for c in counts(model))
    BalancingBiasUpdater(model)  # hooks the model again
    model(input_ids, use_cache=False)
    assert all(c.sum() == 16 for c in counts(model))
