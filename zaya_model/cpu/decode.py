"""Compiled decode steps: one token per sequence through the model's own modules, as one `torch.compile` graph.

At small batch an eager decode step of a small MoE model is bound by the fixed cost of a few hundred small kernels
(norms, router, convolution taps, cache writes), not by arithmetic. Inductor fuses a whole step into a few dozen loops,
but only a graph with no host synchronisation and no data-dependent shapes. The step here computes what the reference
forward computes for one token, with two changes that keep every shape fixed from step to step:
- keys and values are written in place into buffers of a fixed capacity (`StaticDecodeCache`), at one slot shared by
  every row, and attention reads every slot, masked to the ones each row attends to;
- each token's experts are computed by gathering its expert's weights (`zaya_model.kernels.gathered_experts`)
  instead of grouping tokens by expert, which needs the group sizes on the host.

`CompiledDecoder` compiles one graph per batch size (callers round batch sizes up to a few buckets and pad rows);
the capacity dimension is dynamic, so a growing cache does not recompile. The model's weights are graph inputs, so
trained or reloaded weights are read, never baked in. Only public `torch.compile` is used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..cache_zaya import ZayaCache
from ..kernels.gathered_experts import gathered_products
from ..modeling_zaya import ZayaForCausalLM

CAPACITY_STEP = 256
RECOMPILE_LIMIT = 64


def capacity_for(length: int) -> int:
    """Slots for a cache that must hold `length` entries: rounded up to `CAPACITY_STEP`."""
    return -(-length // CAPACITY_STEP) * CAPACITY_STEP


def batch_bucket(rows: int, max_rows: int) -> int:
    """The batch size a step of `rows` rows runs at: the next power of two, capped at `max_rows`."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return max(min(bucket, max_rows), rows)


def attend_one_query(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Softmax attention of one query per row, `query` [batch, heads, 1, d], over `keys`/`values`
    [batch, kv_heads, capacity, d] where `attend` [batch, capacity] -> [batch, 1, heads, d]. Written as products and
    sums, which inductor fuses into its loops; SDPA's fixed cost per call exceeds this whole computation."""
    batch, heads, _, head_dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)
    scores = (grouped[:, :, :, None, :] * keys[:, :, None]).sum(-1) * scaling
    scores = scores.masked_fill(~attend[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    # Slots never written hold whatever the memory held, NaN included: select them away (0 * NaN is NaN).
    values = torch.where(attend[:, None, :, None], values, 0.0)
    return (weights[..., None] * values[:, :, None]).sum(-2).view(batch, 1, heads, head_dim)


def decode_step(
    model: ZayaForCausalLM,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attend: torch.Tensor,
    slot: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    conv_states: list[torch.Tensor],
    shift_states: list[torch.Tensor],
) -> torch.Tensor:
    """One token per row of `input_ids`, `position_ids` [batch, 1] -> logits [batch, vocab].

    `attend` [batch, capacity] marks the slots each row attends to, this step's `slot` [1] included. Writes this
    step's keys and values into `keys`/`values` [batch, kv_heads, capacity, head_dim] at `slot`, and the CCA state
    after the token into `conv_states`/`shift_states`, all in place.
    """
    inner, config = model.model, model.config
    batch = input_ids.shape[0]
    embeds = inner.embed_tokens(input_ids)
    dtype = embeds.dtype
    residual_dtype = torch.float32 if config.residual_in_fp32 else dtype
    position_embeddings = inner.rotary_emb(position_ids, dtype)
    residual = ((embeds + inner.input_hidden_states_bias) * inner.input_hidden_states_scale).to(residual_dtype)
    router_states = None
    for layer, key_cache, value_cache, conv_state, shift_state in zip(
        inner.decoder_layers(), keys, values, conv_states, shift_states, strict=True
    ):
        attention = layer.self_attn
        query_key, value, new_conv_state, new_shift_state = attention.qkv_proj.project(
            layer.input_layernorm(residual.to(dtype)), conv_state, shift_state, None
        )
        conv_state.copy_(new_conv_state)
        shift_state.copy_(new_shift_state)
        query, key = attention.rotated_queries_and_keys(query_key, position_embeddings)
        key_cache.index_copy_(2, slot, key)
        value_cache.index_copy_(2, slot, value.transpose(1, 2))
        attended = attend_one_query(query, key_cache, value_cache, attend, attention.scaling)
        residual = layer.post_attention_residual_scale(attention.o_proj(attended.reshape(batch, 1, -1)), residual)
        moe_input = layer.post_attention_layernorm(residual.to(dtype))
        block = layer.mlp
        _, choice, weight, router_states = block.gate(moe_input, router_states)
        experts = functools.partial(gathered_products, block.experts)
        residual = layer.post_mlp_residual_scale(block.expert_outputs(moe_input, choice, weight, experts), residual)
    return model.lm_head(inner.norm(residual.to(dtype)))[:, -1]


@dataclass
class StaticDecodeCache:
    """Per layer: keys, values [batch, kv_heads, capacity, d], conv state [batch, H, channels], shift state
    [batch, width]: a `ZayaCache`'s contents in buffers of fixed shape, rows past the cache's own padded."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    conv_states: list[torch.Tensor]
    shift_states: list[torch.Tensor]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @classmethod
    def adopt(cls, cache: ZayaCache, batch: int, capacity: int) -> StaticDecodeCache:
        """Copy `cache` (every layer filled, one length) into new buffers of `batch` rows and `capacity` slots, then
        point `cache`'s layers at views of them, so that steps written into the buffers are the cache's own."""
        buffers = cls([], [], [], [])
        for layer in cache.layers:
            keys, values, conv_state, shift_state = layer.keys, layer.values, layer.conv_state, layer.shift_state
            if keys is None or values is None or conv_state is None or shift_state is None:
                raise ValueError("StaticDecodeCache.adopt needs every layer of the cache filled")
            rows, length = keys.shape[0], layer.length
            for source, target in (
                (keys, buffers.keys),
                (values, buffers.values),
                (conv_state, buffers.conv_states),
                (shift_state, buffers.shift_states),
            ):
                shape = list(source.shape)
                shape[0] = batch
                if source.dim() == 4:
                    shape[2] = capacity
                    buffer = source.new_zeros(shape)
                    buffer[:rows, :, :length] = source[:, :, :length]
                else:
                    buffer = source.new_zeros(shape)
                    buffer[:rows] = source
                target.append(buffer)
            layer.keys, layer.values = buffers.keys[-1][:rows], buffers.values[-1][:rows]
            layer.conv_state, layer.shift_state = buffers.conv_states[-1][:rows], buffers.shift_states[-1][:rows]
        return buffers


class CompiledDecoder:
    """`decode_step` compiled with `torch.compile`: one graph per batch size, capacity dynamic."""

    def __init__(self, model: ZayaForCausalLM):
        self.model = model
        self._step = torch.compile(decode_step, fullgraph=True)
        # Every decoder's graphs are entries of `decode_step`'s one code object: room for several models' buckets.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.batch_sizes: set[int] = set()

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attend: torch.Tensor,
        slot: torch.Tensor,
        buffers: StaticDecodeCache,
    ) -> torch.Tensor:
        """`decode_step` over `buffers`; rows of `input_ids` etc. must number `buffers.batch`."""
        for tensor in (*buffers.keys, *buffers.values):
            torch._dynamo.mark_dynamic(tensor, 2)
        torch._dynamo.mark_dynamic(attend, 1)
        self.batch_sizes.add(input_ids.shape[0])
        return self._step(
            self.model,
            input_ids,
            position_ids,
            attend,
            slot,
            buffers.keys,
            buffers.values,
            buffers.conv_states,
            buffers.shift_states,
        )

    @torch.inference_mode()
    def warm(self, batch: int, capacity: int = CAPACITY_STEP) -> None:
        """Compile the graph for `batch` rows now, on dummy inputs. Decoding runs in inference mode (the local engine,
        `greedy_generate`), so the dummy buffers are made in it too: graphs guard on whether their inputs are
        inference tensors, and a graph warmed on ordinary tensors would be compiled again at its first real step."""
        config = self.model.config
        cache = ZayaCache(config)
        dtype = self.model.dtype
        template = torch.zeros(1, config.num_key_value_heads, 1, config.head_dim, dtype=dtype)
        for layer in cache.layers:
            layer.update(template, template)
            layer.conv_state = torch.zeros(1, config.cca_history, config.cca_channels, dtype=dtype)
            layer.shift_state = torch.zeros(1, config.key_width // 2, dtype=dtype)
        buffers = StaticDecodeCache.adopt(cache, batch, capacity)
        attend = torch.zeros(batch, capacity, dtype=torch.bool)
        attend[:, :2] = True
        self(
            torch.zeros(batch, 1, dtype=torch.long),
            torch.ones(batch, 1, dtype=torch.long),
            attend,
            torch.ones(1, dtype=torch.long),
            buffers,
        )


__all__ = [
    "CAPACITY_STEP",
    "CompiledDecoder",
    "StaticDecodeCache",
    "attend_one_query",
    "batch_bucket",
    "capacity_for",
    "decode_step",
    "greedy_generate",
]


@torch.inference_mode()
def greedy_generate(
    model: ZayaForCausalLM, decoder: CompiledDecoder, input_ids: torch.Tensor, new_tokens: int
) -> torch.Tensor:
    """`new_tokens` greedy tokens per row of `input_ids` [batch, prompt] (no padding, no EOS): the prompt's prefill
    through `model`, then every decode step through `decoder` -> the new tokens [batch, new_tokens]."""
    batch, length = input_ids.shape
    output = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    token = output.logits[:, -1].argmax(-1, keepdim=True)
    tokens = [token]
    buffers = StaticDecodeCache.adopt(output.past_key_values, batch, capacity_for(length + new_tokens))
    attend = torch.zeros(batch, buffers.capacity, dtype=torch.bool)
    attend[:, :length] = True
    for _ in range(new_tokens - 1):
        attend[:, length] = True
        position = torch.full((batch, 1), length)
        token = decoder(token, position, attend, torch.tensor([length]), buffers).argmax(-1, keepdim=True)
        tokens.append(token)
        length += 1
    return torch.cat(tokens, dim=1)
