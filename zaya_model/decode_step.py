"""A compiled decode step for `generate()`: one fixed-shape program per batch size and cache capacity.

At batch 1 an eager decode step of a small MoE model is bound neither by arithmetic nor by reading the weights but
by the fixed cost of a few hundred small kernels (norms, router, convolution taps, cache writes). Inductor fuses a
whole step into a few dozen loops, but only a graph with fixed shapes and no data-dependent branches. This module
builds that graph from the model's own modules, changing two things:
- keys and values are written in place into buffers reserved for the whole generation (`ZayaCache(reserved=...)`)
  and attention reads every slot, masked to the filled ones, so shapes stay the same from step to step;
- each token's expert weights are gathered by its routing choice (top-1: one expert per token) instead of grouping
  tokens by expert, which needs the group sizes on the host.

The step is traced once per shape with `make_fx` (the model's weights are inputs of the graph, so trained or
reloaded weights are read, never baked in) and compiled by inductor, then called directly: torch.compile's dynamo
layer (guards, collecting the weights from the module tree, its runtime wrappers) cost ~1 ms a step, as much as
a fifth of a batch-1 step of model_bench's model.

Opt in with `ZayaForCausalLM.enable_compiled_decode()`. The first step of each batch size and capacity compiles
(seconds; tens of seconds without inductor's cache); capacities are rounded up to `CAPACITY_STEP` so that
generations of similar lengths share one. Models with adapters (PEFT layers or parametrized weights) keep the eager
path, which applies them.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import torch
from torch import nn
from torch._guards import TracingContext, tracing
from torch._inductor.compile_fx import compile_fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .cache_zaya import ZayaCache
from .kernels.gathered_experts import gathered_products
from .small_batch_linear import traced_for_inductor

CAPACITY_STEP = 256


def reserved_capacity(max_cache_length: int) -> int:
    return -(-max_cache_length // CAPACITY_STEP) * CAPACITY_STEP


def _routed_experts(block: nn.Module, hidden_states: torch.Tensor, router_states: torch.Tensor | None):
    """`ZayaSparseMoeBlock` for a few tokens without host synchronisation: every token reads its own expert's
    weights (`ZayaExperts.gathered`; too few tokens to be worth sorting)."""
    logits, choice, weight, router_states = block.gate(hidden_states, router_states)
    experts = functools.partial(gathered_products, block.experts)
    return block.expert_outputs(hidden_states, choice, weight, experts), router_states


def _attend_one_query(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Softmax attention of one query per row, `query` [batch, heads, 1, d], over `keys`/`values`
    [batch, kv_heads, capacity, d] where `attend` [batch, capacity] -> [batch, 1, heads, d]. Written out rather
    than SDPA's kernel, whose fixed cost per call (70 us) exceeds this whole fused computation."""
    batch, heads, _, head_dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)
    # Products and sums, not matmuls: inductor fuses them into loops, while a matmul stays a library call.
    scores = (grouped[:, :, :, None, :] * keys[:, :, None]).sum(-1) * scaling
    scores = scores.masked_fill(~attend[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    # Slots not yet written hold whatever the memory held, NaN included: select them away (0 * NaN is NaN).
    values = torch.where(attend[:, None, :, None], values, 0.0)
    return (weights[..., None] * values[:, :, None]).sum(-2).view(batch, 1, heads, head_dim)


def decode_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attend: torch.Tensor,
    slot: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    conv_states: list[torch.Tensor],
    shift_states: list[torch.Tensor],
):
    """One token per row: `input_ids`, `position_ids` [batch, 1]; `attend` [batch, capacity] marks the slots each row
    attends to (this step's `slot` [1] included). Writes this step's keys and values into `keys`/`values`
    [batch, kv_heads, capacity, head_dim] at `slot`; returns logits [batch, 1, vocab] and the new CCA states."""
    inner, config = model.model, model.config
    batch = input_ids.shape[0]
    embeds = inner.embed_tokens(input_ids)
    dtype = embeds.dtype
    residual_dtype = torch.float32 if config.residual_in_fp32 else dtype
    position_embeddings = inner.rotary_emb(position_ids, dtype)
    residual = ((embeds + inner.input_hidden_states_bias) * inner.input_hidden_states_scale).to(residual_dtype)
    router_states = None
    new_conv_states, new_shift_states = [], []
    for layer, key_cache, value_cache, conv_state, shift_state in zip(
        inner.layers, keys, values, conv_states, shift_states, strict=True
    ):
        attention = layer.self_attn
        query_key, value, conv_state, shift_state = attention.qkv_proj.project(
            layer.input_layernorm(residual.to(dtype)), conv_state, shift_state, None
        )
        # Contiguous copies: the next step's inputs then have the strides the program was compiled for.
        new_conv_states.append(conv_state.clone(memory_format=torch.contiguous_format))
        new_shift_states.append(shift_state.clone(memory_format=torch.contiguous_format))
        query, key = attention.rotated_queries_and_keys(query_key, position_embeddings)
        key_cache.index_copy_(2, slot, key)
        value_cache.index_copy_(2, slot, value.transpose(1, 2))
        attended = _attend_one_query(query, key_cache, value_cache, attend, attention.scaling)
        attention_out = attention.o_proj(attended.reshape(batch, 1, -1))
        residual = layer.post_attention_residual_scale(attention_out, residual)
        moe_out, router_states = _routed_experts(
            layer.mlp, layer.post_attention_layernorm(residual.to(dtype)), router_states
        )
        residual = layer.post_mlp_residual_scale(moe_out, residual)
    logits = model.lm_head(inner.norm(residual.to(dtype)))
    return logits, new_conv_states, new_shift_states


def has_adapters(model: nn.Module) -> bool:
    """Whether any weight is wrapped (PEFT's layers and `target_parameters` hook in this way), which the compiled
    step would bypass."""
    for module in model.modules():
        if type(module).__module__.startswith("peft.") or hasattr(module, "parametrizations"):
            return True
    return False


class _DecodeStep(nn.Module):
    """`decode_logits` over flat tensors, as a module's forward: `torch.func.functional_call` then swaps the model's
    weights for the graph's inputs while `make_fx` traces it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attend, slot, *layer_tensors):
        keys, values, conv_states, shift_states = (list(group) for group in _split(layer_tensors, 4))
        logits, conv_states, shift_states = decode_logits(
            self.model, input_ids, position_ids, attend, slot, keys, values, conv_states, shift_states
        )
        return logits, *conv_states, *shift_states


def _split(tensors, parts: int) -> list[tuple]:
    size = len(tensors) // parts
    return [tuple(tensors[i * size : (i + 1) * size]) for i in range(parts)]


def _sharing(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """Which entries are one tensor object (each entry's first position): compiled code passes a tensor given twice
    (tied weights) once, so a program holds only while this stays the same."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(tensor), i) for i, tensor in enumerate(tensors))


def _layout(tensors: list[torch.Tensor]) -> list[tuple]:
    return [(tensor.shape, tensor.stride(), tensor.dtype, tensor.device) for tensor in tensors]


class _DecodeProgram:
    """`decode_logits` compiled for the shapes of one set of step inputs; it reads the model's weights and buffers
    from their modules on every call, so a tensor replaced after compiling (a reloaded state dict) is used."""

    def __init__(self, model: nn.Module, step_inputs: list[torch.Tensor]):
        # Every module's own entry, tied weights included: a reload may untie them.
        named = [(name, True) for name, _ in model.named_parameters(remove_duplicate=False)]
        named += [(name, False) for name, _ in model.named_buffers(remove_duplicate=False)]
        self.sources = []
        for name, is_parameter in named:
            owner, _, attribute = name.rpartition(".")
            module = model.get_submodule(owner)
            self.sources.append((module._parameters if is_parameter else module._buffers, attribute))
        names = ["model." + name for name, _ in named]
        step = _DecodeStep(model)

        def traced(*tensors):
            weights = dict(zip(names, tensors[: len(names)], strict=True))
            return torch.func.functional_call(step, weights, tensors[len(names) :], tie_weights=False)

        weights = self.weights()
        self.checked_weights, self.sharing, self.layout = weights, _sharing(weights), _layout(weights)
        example = [*weights, *step_inputs]
        # One fake-tensor mode with a shape environment for tracing and compiling, as torch.compile sets up: inductor
        # caches compiled graphs (across processes too) only where it finds one.
        fake_mode = FakeTensorMode(allow_fallback_kernels=True, shape_env=ShapeEnv(), static_shapes=True)
        with torch.no_grad(), traced_for_inductor(), tracing(TracingContext(fake_mode)):
            graph = make_fx(traced, tracing_mode="fake")(*example)
            # Inductor's own checks of every input's sizes and strides cost ~5% of a batch-1 step: the weights are
            # checked in `__call__` when one changes, and `CompiledDecode` builds the step inputs with fixed layouts.
            self.run: Callable = compile_fx(graph, example, config_patches={"size_asserts": False})

    def weights(self) -> list[torch.Tensor]:
        return [store[attribute] for store, attribute in self.sources]

    def __call__(self, step_inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
        """The step's outputs, or None when the model's weights are no longer shared or laid out as when compiled."""
        weights = self.weights()
        if not all(map(operator.is_, weights, self.checked_weights)):
            if _sharing(weights) != self.sharing or _layout(weights) != self.layout:
                return None
            self.checked_weights = weights
        return self.run(*weights, *step_inputs)


class CompiledDecode:
    """The compiled decode programs of one model, one per (batch, capacity, dtype, device), and the host-side
    bookkeeping of each step."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.programs: dict[tuple, _DecodeProgram] = {}

    @property
    def compiled_for(self) -> set[tuple]:
        return set(self.programs)

    def new_cache(self, max_cache_length: int) -> ZayaCache | None:
        """A cache reserved for a generation of up to `max_cache_length` tokens, or None when the model carries
        adapters (the eager path applies them)."""
        if has_adapters(self.model):
            return None
        return ZayaCache(self.model.config, reserved=reserved_capacity(max_cache_length), compiled_decode=True)

    def applies(self, input_ids: torch.Tensor | None, cache: ZayaCache | None) -> bool:
        return (
            cache is not None
            and cache.compiled_decode
            and input_ids is not None
            and input_ids.shape[1] == 1
            and 0 < cache.get_seq_length() < cache.capacity()
            and not torch.is_grad_enabled()
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        cache: ZayaCache,
    ) -> torch.Tensor:
        batch, length, capacity = input_ids.shape[0], cache.get_seq_length(), cache.capacity()
        device = input_ids.device
        if position_ids is None:
            position_ids = torch.full((batch, 1), length, device=device)
        attend = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        if attention_mask is None:
            attend[:, : length + 1] = True
        else:
            attend[:, : length + 1] = attention_mask[:, -(length + 1) :].bool()
        layers = cache.layers
        step_inputs = [
            input_ids.reshape(batch, 1).contiguous(),
            position_ids.reshape(batch, 1).contiguous(),
            attend,
            torch.tensor([length], device=device),
            *(layer.keys for layer in layers),
            *(layer.values for layer in layers),
            # The prefill leaves the CCA states as views of larger tensors. Contiguous is enough: with size checks
            # off, a size-1 dimension's stride (all `is_contiguous` ignores) is never used.
            *(layer.conv_state.contiguous() for layer in layers),
            *(layer.shift_state.contiguous() for layer in layers),
        ]
        key = (batch, capacity, layers[0].keys.dtype, device)
        program = self.programs.get(key)
        outputs = None if program is None else program(step_inputs)
        if outputs is None:  # a new shape, or weights tied, untied or laid out anew since compiling
            program = self.programs[key] = _DecodeProgram(self.model, step_inputs)
            outputs = program(step_inputs)
        logits, *states = outputs
        conv_states, shift_states = _split(states, 2)
        cache.advance(conv_states, shift_states)
        return logits
