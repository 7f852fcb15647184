"""The `gathered` experts implementation equals the reference experts, compiled into one graph; eagerly it is the
reference itself."""

import pytest
import torch
from tiny_models import TINY_ZAYA, skip_prone_model

import zaya_model.kernels  # noqa: F401  (registers the kernels)


@pytest.mark.parametrize("skip_mode", ["zero", "scaled_input"])
def test_gathered_experts_in_a_compiled_graph_equal_the_reference(skip_mode):
    torch.manual_seed(0)
    model = skip_prone_model(torch.randint(3, TINY_ZAYA["vocab_size"], (1, 16)), skip_expert_mode=skip_mode)
    block = model.model.layers[1].mlp
    hidden = torch.randn(2, 17, TINY_ZAYA["hidden_size"])
    # Choices spread over every expert and the skip class, in no order.
    choice = (torch.arange(34).reshape(2, 17) * 7) % (TINY_ZAYA["num_experts"] + 1)
    weight = torch.rand(2, 17, 1)
    with torch.no_grad():
        expected = block.expert_outputs(hidden, choice, weight)
        model.set_experts_implementation("gathered")
        assert block.experts.config._experts_implementation == "gathered"
        compiled = torch.compile(block.expert_outputs, fullgraph=True)  # no graph break: shapes ignore the routing
        torch.testing.assert_close(compiled(hidden, choice, weight), expected, rtol=0, atol=1e-6)
        # Outside a compiled graph the reference runs (indexing would copy each token's weights).
        assert torch.equal(block.expert_outputs(hidden, choice, weight), expected)


def test_the_reference_is_the_default_and_unknown_implementations_are_refused(tiny_model):
    assert tiny_model.config._experts_implementation == "eager"
    with pytest.raises(ValueError, match="not supported"):
        tiny_model.set_experts_implementation("no-such-kernel")
