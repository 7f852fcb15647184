"""ZAYA1: Compressed Convolutional Attention + top-1 MoE with the ZAYA router, as a HuggingFace model.

Read top to bottom: norms and RoPE, CCA (projections, convolutions, value shift, QK norm), the attention layer,
residual scaling, the router and experts, the decoder block, and the models. The math follows
`shared/docs/zaya1-architecture.md`; parameter names follow the upstream `transformers` `zaya` layout so checkpoints
move freely between the two.

Packed batches: `position_ids` that restart at 0 mark document starts. Attention is masked per document (via
`create_causal_mask`), and the convolutions and the value shift never read a token from an earlier document: a
token at position p only sees the p tokens before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.integrations.moe import use_experts_implementation
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .cache_zaya import ZayaCache
from .configuration_zaya import ZayaConfig
from .expert_lora import ExpertWeight, expert_weight, peft_expert_weights
from .grouped_linear import group_layout, group_row_multiple

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

# Forward flags that `capture_outputs` reads; the rest of a forward's `**kwargs` goes to the attention kernels.
OUTPUT_FLAGS = ("output_attentions", "output_hidden_states", "output_router_logits")
# Keyword arguments of `ZayaForCausalLM.forward` that are the loss function's.
LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


class ZayaRMSNorm(nn.Module):
    """RMSNorm with statistics in fp32, cast back to the input dtype before the learned scale."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = (hidden_states.shape[-1],)
        if hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(hidden_states, shape, self.weight, eps=self.variance_epsilon)  # one kernel
        normed = F.rms_norm(hidden_states.to(torch.float32), shape, eps=self.variance_epsilon)
        return self.weight * normed.to(hidden_states.dtype)


class ZayaRotaryEmbedding(nn.Module):
    """Partial NeoX RoPE on the first `partial_rotary_factor * head_dim` channels of each head.

    Returns full-width `(cos, sin)` so that a layer rotates with three kernels, `x * cos + swapped(x) * sin`, where
    `swapped` exchanges the two rotary halves: `sin` carries rotate-half's sign, and the pass-through channels get
    `cos = 1, sin = 0`.
    """

    def __init__(self, config: ZayaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.base = config.rope_theta
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
        return 1.0 / (self.base**exponents)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`position_ids` [batch, seq] -> cos, sin [batch, seq, 1, head_dim]."""
        freqs = position_ids[..., None].to(torch.float32) * self.inv_freq.to(position_ids.device)
        cos, sin = freqs.cos(), freqs.sin()
        passed = self.head_dim - self.rotary_dim
        cos = torch.cat((cos, cos, cos.new_ones(*cos.shape[:-1], passed)), dim=-1)
        sin = torch.cat((-sin, sin, sin.new_zeros(*sin.shape[:-1], passed)), dim=-1)
        return cos[:, :, None].to(dtype), sin[:, :, None].to(dtype)


def apply_partial_rope(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate-half RoPE of `states` [batch, seq, heads, head_dim] with `ZayaRotaryEmbedding`'s tables."""
    half = rotary_dim // 2
    # Slices joined by `cat`: an `index_select` along the last dimension gathers element by element (much slower).
    swapped = torch.cat((states[..., half:rotary_dim], states[..., :half], states[..., rotary_dim:]), dim=-1)
    return torch.addcmul(states * cos, swapped, sin)


def shift_by(states: torch.Tensor, history: torch.Tensor, lag: int) -> torch.Tensor:
    """`states` [batch, seq, ch] delayed by `lag` steps; the first `lag` steps come from `history` [batch, H, ch]."""
    if lag == 0:
        return states
    full = torch.cat((history, states), dim=1)
    start = history.shape[1] - lag
    return full[:, start : start + states.shape[1]]


class ConvParameters(Protocol):
    """What CCA's convolutions read of a `Conv1d`: `weight` [out, in / groups, kernel] and `bias` [out]."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def bias(self) -> torch.Tensor | None: ...


def convolve_receptive_fields(fields: torch.Tensor, depthwise: ConvParameters, grouped: ConvParameters) -> torch.Tensor:
    """CCA's two causal convolutions for each token from its receptive field `fields` [..., channels, history + 1]
    (oldest frame first, the token itself last) -> [..., channels].

    `depthwise` and `grouped` hold `Conv1d`-shaped `weight` and `bias` (the vLLM plugin calls this too). The
    depthwise kernel runs as one multiply-add per tap (a reduction over the kernel is much slower); the grouped
    kernel as one batched matmul, per group `[tokens, width * k1] @ [width * k1, width]`.
    """
    *leading, channels, _ = fields.shape
    if depthwise.bias is None or grouped.bias is None:
        raise ValueError("CCA's convolutions have biases")
    depthwise_kernel, grouped_kernel = depthwise.weight.shape[-1], grouped.weight.shape[-1]
    # Depthwise outputs at the grouped kernel's taps, oldest first, stacked to [..., channels, k1]. One column per
    # tap, each reading one frame of every channel: computed as a whole, inductor folded the taps into the grouped
    # matmul's reduction and recomputed them there in scalar loops (the compiled decode step's slowest part).
    columns = []
    for tap in range(grouped_kernel):
        column = depthwise.bias
        for lag in range(depthwise_kernel):
            column = torch.addcmul(column, fields[..., tap + lag], depthwise.weight[:, 0, lag])
        columns.append(column)
    out = torch.stack(columns, dim=-1)
    group_width = grouped.weight.shape[1]
    groups = channels // group_width
    stacked = out.reshape(-1, groups, group_width * grouped_kernel)
    weight = grouped.weight.view(groups, group_width, group_width * grouped_kernel)
    mixed = torch.bmm(stacked.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)
    return mixed.reshape(*leading, channels) + grouped.bias


class ZayaCCAProjection(nn.Module):
    """CCA's q/k/v: down-projections, two causal convolutions over q‖k, the q-k mean skip and the value shift."""

    def __init__(self, config: ZayaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.depthwise_kernel = config.cca_time0
        self.grouped_kernel = config.cca_time1
        # Tokens of history the two convolutions read together (each kernel of size k looks k-1 steps back).
        self.history = self.depthwise_kernel + self.grouped_kernel - 2

        query_width = self.num_heads * self.head_dim
        key_width = self.num_key_value_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, query_width, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, key_width, bias=bias)
        self.v_proj_current = nn.Linear(config.hidden_size, key_width // 2, bias=bias)
        self.v_proj_delayed = nn.Linear(config.hidden_size, key_width // 2, bias=bias)
        channels = query_width + key_width
        self.conv_qk_depthwise = nn.Conv1d(channels, channels, self.depthwise_kernel, groups=channels)
        self.conv_qk_grouped = nn.Conv1d(
            channels, channels, self.grouped_kernel, groups=self.num_heads + self.num_key_value_heads
        )

    def causal_convolutions(self, window: torch.Tensor, lag_masks: torch.Tensor | None) -> torch.Tensor:
        """Both causal convolutions over `window` [batch, H + seq, channels]: H frames of history, then the chunk's
        packed q/k -> [batch, seq, channels].

        Long chunks run as two `Conv1d`s over the window. With `lag_masks` (packed training, left padding) the few
        tokens whose receptive field crosses a document start (the first H of each document) are then recomputed
        from their own fields, cut at that start, which a sliding kernel cannot do. Short chunks (decode steps)
        gather each token's receptive field (a view): a few fused kernels replace the convolutions' fixed cost,
        which dwarfs the arithmetic of one token. Compiled, masked chunks of any length take that path too: finding
        the tokens to recompute is data-dependent (`nonzero`), which would split the graph into a dozen.
        """
        cut_in_graph = lag_masks is not None and torch.compiler.is_compiling()
        if window.shape[1] - self.history > 32 and not cut_in_graph:
            convolved = self.conv_qk_grouped(self.conv_qk_depthwise(window.transpose(1, 2)))
            # Back to [batch, seq, channels] memory order: attention kernels want head_dim contiguous.
            convolved = convolved.transpose(1, 2).contiguous()
            return convolved if lag_masks is None else self._cut_at_document_starts(convolved, window, lag_masks)
        # [batch, seq, channels, history + 1]: each token's receptive field, oldest frame first.
        fields = window.unfold(1, self.history + 1, 1)
        if lag_masks is not None:
            fields = fields * lag_masks[..., : self.history + 1].flip(-1)[:, :, None, :]
        return convolve_receptive_fields(fields, self.conv_qk_depthwise, self.conv_qk_grouped)

    def _cut_at_document_starts(
        self, convolved: torch.Tensor, window: torch.Tensor, lag_masks: torch.Tensor
    ) -> torch.Tensor:
        # Recomputing every token from masked fields cost a packed 4x512 train step a quarter of its time.
        masks = lag_masks[..., : self.history + 1]
        rows, tokens = (masks == 0).any(dim=-1).nonzero(as_tuple=True)
        if rows.numel() == 0:
            return convolved
        frames = tokens[:, None] + torch.arange(self.history + 1, device=tokens.device)  # window index, oldest first
        fields = window[rows[:, None], frames].transpose(1, 2) * masks[rows, tokens].flip(-1)[:, None, :]
        recomputed = convolve_receptive_fields(fields, self.conv_qk_depthwise, self.conv_qk_grouped)
        # Under CPU autocast the Conv1d ran in bf16 while the recomputation's multiply-adds stayed in fp32.
        return convolved.index_put((rows, tokens), recomputed.to(convolved.dtype))

    def zero_state(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The state before a sequence's first token: no history for the convolutions or the value shift."""
        batch, channels = hidden_states.shape[0], self.q_proj.out_features + self.k_proj.out_features
        return (
            hidden_states.new_zeros(batch, self.history, channels),
            hidden_states.new_zeros(batch, self.v_proj_delayed.out_features),
        )

    def project(
        self,
        hidden_states: torch.Tensor,
        conv_history: torch.Tensor,
        shift_history: torch.Tensor,
        lag_masks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q/k/v for `hidden_states` [batch, seq, hidden] following the state `conv_history` [batch, H, channels]
        and `shift_history` [batch, delayed width] -> queries and keys [batch, seq, heads + kv_heads, head_dim],
        values [batch, seq, kv_heads, head_dim] and the state after the chunk (both histories)."""
        batch, seq, _ = hidden_states.shape
        queries = self.q_proj(hidden_states)
        keys = self.k_proj(hidden_states)
        window = torch.cat((conv_history, torch.cat((queries, keys), dim=-1)), dim=1)
        convolved = self.causal_convolutions(window, lag_masks)

        # q-k mean skip on the pre-convolution projections: q_h += (q_h + k_g(h)) / 2, k_g += (mean q_g + k_g) / 2.
        queries = queries.view(batch, seq, self.num_key_value_heads, self.num_key_value_groups, self.head_dim)
        keys = keys.view(batch, seq, self.num_key_value_heads, 1, self.head_dim)
        query_skip = (queries + keys) * 0.5
        skip = torch.cat((query_skip.view(batch, seq, self.num_heads, self.head_dim), query_skip.mean(dim=3)), dim=2)
        # Queries and keys stay one tensor [batch, seq, heads + kv_heads, head_dim] through norm and RoPE.
        query_key = convolved.view(batch, seq, self.num_heads + self.num_key_value_heads, self.head_dim) + skip

        # Value shift: the second half of the value heads carries the previous token's projection.
        value_current = self.v_proj_current(hidden_states)
        delayed = self.v_proj_delayed(hidden_states)
        value_delayed = shift_by(delayed, shift_history[:, None], 1)
        if lag_masks is not None:
            value_delayed = value_delayed * lag_masks[..., 1:2]
        value = torch.cat((value_current, value_delayed), dim=-1).view(batch, seq, self.num_key_value_heads, -1)

        # Sliced from the front: `[:, -history:]` would keep everything when the kernels read no history.
        conv_state = window[:, window.shape[1] - self.history :]
        return query_key, value, conv_state, delayed[:, -1]


class ZayaQKNorm(nn.Module):
    """L2-normalise q and k to norm sqrt(head_dim); keys are then scaled by a learned per-KV-head temperature.

    Scaling a vector to norm sqrt(d) is exactly an RMS norm, so queries and keys [.., heads + kv_heads, d] take one
    `rms_norm` and one multiply by (1 per query head, temperature per key head).
    """

    def __init__(self, config: ZayaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.temp = nn.Parameter(torch.ones(config.num_key_value_heads))

    def forward(self, query_key: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(query_key.dtype).eps ** 2  # for the mean square: F.normalize's eps applies to the norm
        normed = F.rms_norm(query_key, (query_key.shape[-1],), eps=eps)
        head_scale = torch.cat((self.temp.new_ones(self.num_heads), self.temp)).to(normed.dtype)
        return normed * head_scale[:, None]


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Reference GQA attention with an fp32 softmax, for `attn_implementation="eager"`."""
    key = key.repeat_interleave(module.num_key_value_groups, dim=1)
    value = value.repeat_interleave(module.num_key_value_groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class ZayaAttention(nn.Module):
    """CCA attention: compressed q/k/v from `ZayaCCAProjection`, QK norm, partial RoPE, GQA softmax attention."""

    def __init__(self, config: ZayaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.rotary_dim = config.rotary_dim
        self.is_causal = True
        self.qkv_proj = ZayaCCAProjection(config, layer_idx)
        self.qk_norm = ZayaQKNorm(config)
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        lag_masks: torch.Tensor | None,
        past_key_values: ZayaCache | None = None,
        padding_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Attention for a chunk after whatever `past_key_values` holds (if anything), which it then extends."""
        previous_state = None if past_key_values is None else past_key_values.cca_state(self.layer_idx)
        if past_key_values is None or previous_state is None:
            output, state = self.attend_chunk(
                hidden_states, position_embeddings, attention_mask, lag_masks, padding_mask, **kwargs
            )
            if past_key_values is not None:
                self.cache_state(past_key_values, *state)
            return output
        if padding_mask is not None:
            hidden_states = hidden_states * padding_mask
        query_key, value, conv_state, shift_state = self.qkv_proj.project(hidden_states, *previous_state, lag_masks)
        past_key_values.update_cca_state(self.layer_idx, conv_state.detach(), shift_state.detach())
        query, key = self.rotated_queries_and_keys(query_key, position_embeddings)
        key, value = past_key_values.update(key, value.transpose(1, 2), self.layer_idx)
        return self._attend(query, key, value, attention_mask, **kwargs)

    def attend_chunk(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        lag_masks: torch.Tensor | None,
        padding_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Attention for a chunk that starts its sequences (a training batch, a prompt): no cache is read, so this
        is a function of tensors alone, which `torch.compile` can take whole. Returns the output and what a cache
        keeps after the chunk: keys, values [batch, kv_heads, seq, d], conv state and shift state."""
        if padding_mask is not None:
            hidden_states = hidden_states * padding_mask
        query_key, value, conv_state, shift_state = self.qkv_proj.project(
            hidden_states, *self.qkv_proj.zero_state(hidden_states), lag_masks
        )
        query, key = self.rotated_queries_and_keys(query_key, position_embeddings)
        value = value.transpose(1, 2)
        output = self._attend(query, key, value, attention_mask, **kwargs)
        return output, (key, value, conv_state, shift_state)

    def cache_state(
        self,
        past_key_values: ZayaCache,
        key: torch.Tensor,
        value: torch.Tensor,
        conv_state: torch.Tensor,
        shift_state: torch.Tensor,
    ) -> None:
        """Store `attend_chunk`'s state as this layer's first entry in `past_key_values`."""
        past_key_values.update_cca_state(self.layer_idx, conv_state.detach(), shift_state.detach())
        past_key_values.update(key.detach(), value.detach(), self.layer_idx)

    def _attend(self, query, key, value, attention_mask, **kwargs) -> torch.Tensor:
        batch, _, seq, _ = query.shape
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, _ = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.config.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        return self.o_proj(output.reshape(batch, seq, -1))

    def rotated_queries_and_keys(
        self, query_key: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """QK norm and RoPE on `query_key` [batch, seq, heads + kv_heads, d] -> queries [batch, heads, seq, d] and
        keys [batch, kv_heads, seq, d] (the compiled decode step, `zaya_model.cpu.decode`, calls it too)."""
        query_key = apply_partial_rope(self.qk_norm(query_key), *position_embeddings, self.rotary_dim).transpose(1, 2)
        return query_key.split((self.num_heads, self.num_key_value_heads), dim=1)


class ZayaResidualScaling(nn.Module):
    """Learned residual merge: `(out + b_h) * s_h + (residual + b_r) * s_r` (bias before scale, per channel)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_states_scale = nn.Parameter(torch.ones(hidden_size))
        self.hidden_states_bias = nn.Parameter(torch.zeros(hidden_size))
        self.residual_scale = nn.Parameter(torch.ones(hidden_size))
        self.residual_bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        merged = (hidden_states + self.hidden_states_bias) * self.hidden_states_scale
        return merged + (residual + self.residual_bias) * self.residual_scale


class ZayaRouterMLP(nn.Module):
    """RMSNorm -> Linear+GELU -> Linear+GELU -> Linear (no bias) to the expert classes (experts + skip)."""

    def __init__(self, hidden_size: int, num_classes: int, eps: float):
        super().__init__()
        self.norm = ZayaRMSNorm(hidden_size, eps=eps)
        self.fc1 = nn.Linear(hidden_size, hidden_size)
        self.fc2 = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, num_classes, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = F.gelu(self.fc1(self.norm(hidden_states)))
        return self.out_proj(F.gelu(self.fc2(hidden_states)))


class ZayaRouter(nn.Module):
    """The ZAYA router: down-projection, exponential depth averaging (EDA) with the previous MoE layer's router state,
    an MLP over `num_experts + 1` classes (the last is "skip"), and top-1 selection with balancing biases that change
    the choice but not the mixing weight."""

    def __init__(self, config: ZayaConfig, layer_idx: int):
        super().__init__()
        self.num_experts = config.num_experts
        self.down_proj = nn.Linear(config.hidden_size, config.router_hidden_size)
        self.use_eda = layer_idx != 0
        if self.use_eda:
            self.router_states_scale = nn.Parameter(torch.ones(config.router_hidden_size))
        self.router_mlp = ZayaRouterMLP(config.router_hidden_size, config.num_experts + 1, config.router_norm_eps)
        # Not trained by backprop: moved by the balancing-bias update (see `zaya_model.training.balancing`).
        self.balancing_biases: torch.Tensor
        self.register_buffer("balancing_biases", torch.zeros(config.num_experts + 1, dtype=torch.float32))
        # Routed tokens per class, summed over training forwards by a `RoutedTokenCounter` (which the balancing
        # update installs) until the update consumes them.
        self.routed_token_counts: torch.Tensor | None = None

    def forward(
        self, hidden_states: torch.Tensor, router_states: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (router logits, chosen class per token, its unbiased probability, next layer's router state)."""
        router_hidden = self.down_proj(hidden_states)
        if self.use_eda and router_states is not None:
            router_hidden = router_hidden + router_states * self.router_states_scale
        logits = self.router_mlp(router_hidden)
        probs = torch.softmax(logits.to(torch.float32), dim=-1)
        choice = torch.argmax(probs.detach() + self.balancing_biases, dim=-1)
        weight = probs.gather(-1, choice[..., None])
        return logits, choice, weight, router_hidden


@use_experts_implementation
class ZayaExperts(nn.Module):
    """Top-1 SwiGLU experts with fused 3-D weights: `gate_up_proj` [E, 2I, H] (gate rows first), `down_proj` [E, H, I].

    Called as upstream's experts are, so that other experts implementations apply: `forward` is the reference
    ("eager"); others are chosen with `model.set_experts_implementation(name)`. A token routed to the skip class
    comes as expert index E, which transformers' implementations treat as a sentinel (no expert, zero output) and
    ours skip, so it costs no expert compute. The reference groups tokens by expert (`group_layout`) and runs each
    projection as one grouped matmul (`grouped_linear`); no Python loop over tokens. LoRA from PEFT's
    `target_parameters` stays low-rank (`expert_lora`).
    """

    _is_expert_parallel: bool  # set by `use_experts_implementation`

    def __init__(self, config: ZayaConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.intermediate_size = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(config.num_experts, 2 * config.moe_intermediate_size, config.hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, config.moe_intermediate_size))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        adapted: dict[str, ExpertWeight] | None = None,
    ) -> torch.Tensor:
        """`hidden_states` [tokens, H]; `top_k_index`, `top_k_weights` [tokens, 1]: each token's expert in [0, E]
        (E: skipped) and its weight -> the weighted expert outputs [tokens, H], zero for skipped tokens.
        `adapted`: weights given with LoRA factors by name (`peft_expert_weights`), used instead of the module's."""
        expert_index, weights = top_k_index.reshape(-1), top_k_weights.reshape(-1, 1)
        routed = expert_index < self.num_experts
        if not bool(routed.all()):
            rows = routed.nonzero().squeeze(-1)
            output = self(hidden_states.index_select(0, rows), expert_index[rows, None], weights[rows], adapted)
            return torch.zeros_like(hidden_states).index_copy(0, rows, output)
        adapted = adapted or {}
        gate_up = adapted.get("gate_up_proj") or expert_weight(self, "gate_up_proj")
        down = adapted.get("down_proj") or expert_weight(self, "down_proj")
        multiple = group_row_multiple(hidden_states.dtype, hidden_states.device)
        rows, group_sizes = group_layout(expert_index, self.num_experts, multiple)
        # Each token's row; padding rows (low precision) are zero, so they add nothing to any gradient.
        allocate = hidden_states.new_zeros if multiple > 1 else hidden_states.new_empty
        grouped_states = allocate(int(group_sizes.sum()), hidden_states.shape[-1]).index_copy_(0, rows, hidden_states)
        gate, up = gate_up.grouped(grouped_states, group_sizes).split(self.intermediate_size, dim=-1)
        expert_out = down.grouped(self.act_fn(gate) * up, group_sizes).index_select(0, rows)
        return expert_out * weights.to(expert_out.dtype)


class ZayaSparseMoeBlock(nn.Module):
    """Router + experts. A token goes to one expert, weighted by its probability, or to the skip class, which
    outputs zero (upstream) or the input scaled by the skip probability (ZAYA1-base), per `skip_expert_mode`."""

    def __init__(self, config: ZayaConfig, layer_idx: int):
        super().__init__()
        self.gate = ZayaRouter(config, layer_idx)
        self.experts = ZayaExperts(config)
        # Makes transformers' experts implementations read index E (the skip class) as "no expert", as they read
        # the indices of experts held by other ranks under expert parallelism.
        self.experts._is_expert_parallel = True
        self.skip_scales_input = config.skip_expert_mode == "scaled_input"

    def forward(self, hidden_states: torch.Tensor, router_states: torch.Tensor | None):
        logits, choice, weight, router_states = self.gate(hidden_states, router_states)
        return self.expert_outputs(hidden_states, choice, weight), router_states, logits, choice

    def expert_outputs(
        self, hidden_states: torch.Tensor, choice: torch.Tensor, weight: torch.Tensor, run_experts=None
    ) -> torch.Tensor:
        """The MoE output for the router's `choice` [batch, seq] in [0, E] (E: skip) and `weight` [batch, seq, 1]."""
        weight = weight.to(hidden_states.dtype)
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        output = (run_experts or self._run_experts)(flat, choice.reshape(-1, 1), weight.reshape(-1, 1))
        output = output.view_as(hidden_states)
        if self.skip_scales_input:
            skipped = (choice == self.gate.num_experts)[..., None]
            output = output + torch.where(skipped, weight * hidden_states, 0.0)
        return output

    def _run_experts(self, hidden_states: torch.Tensor, expert_index: torch.Tensor, weights: torch.Tensor):
        # With PEFT's expert LoRA, call our experts with the adapters' factors: PEFT's wrappers would register (and
        # so evaluate once) a parametrization of each whole expert stack on every forward.
        adapted = peft_expert_weights(self.experts)
        if adapted is None:
            return self.experts(hidden_states, expert_index, weights)
        experts, factors = adapted
        return experts(hidden_states, expert_index, weights, adapted=factors)


class ZayaDecoderLayer(GradientCheckpointingLayer):
    """One ZAYA block: attention half then MoE half, each pre-normed and merged by residual scaling.

    Returns (residual, router state for the next layer, router logits [tokens, classes], chosen class [batch, seq]).
    The output recorders read hidden states and router logits from this tuple (`_can_record_outputs`): the layer is
    called eagerly even when its parts run compiled (`zaya_model.cpu.compiled_layers`), so hooks on it always run.
    """

    def __init__(self, config: ZayaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = ZayaAttention(config, layer_idx)
        self.mlp = ZayaSparseMoeBlock(config, layer_idx)
        self.input_layernorm = ZayaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = ZayaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_residual_scale = ZayaResidualScaling(config.hidden_size)
        self.post_mlp_residual_scale = ZayaResidualScaling(config.hidden_size)

    def forward(
        self,
        residual: torch.Tensor,
        router_states: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        lag_masks: torch.Tensor | None,
        past_key_values: ZayaCache | None = None,
        padding_mask: torch.Tensor | None = None,
        **kwargs,
    ):
        attn_out = self.self_attn(
            self.input_layernorm(residual.to(self.input_layernorm.weight.dtype)), position_embeddings,
            attention_mask, lag_masks, past_key_values, padding_mask, **kwargs,
        )  # fmt: skip
        residual, moe_input, router_logits, choice, weight, router_states = self.route(
            attn_out, residual, router_states
        )
        moe_out = self.mlp.expert_outputs(moe_input, choice, weight)
        residual = self.post_mlp_residual_scale(moe_out, residual)
        return residual, router_states, router_logits, choice

    def route(self, attn_out: torch.Tensor, residual: torch.Tensor, router_states: torch.Tensor | None):
        """Merge the attention output into the residual, then route its normed MoE input. The router logits come
        flattened to [tokens, classes], as transformers' MoE models return them."""
        residual = self.post_attention_residual_scale(attn_out, residual)
        moe_input = self.post_attention_layernorm(residual.to(self.post_attention_layernorm.weight.dtype))
        logits, choice, weight, router_states = self.mlp.gate(moe_input, router_states)
        return residual, moe_input, logits.flatten(0, -2), choice, weight, router_states


class ZayaPreTrainedModel(PreTrainedModel):
    config_class = ZayaConfig
    config: ZayaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ZayaDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False
    _is_stateful = True
    # `output_hidden_states` / `output_router_logits`: the library's recorders (`capture_outputs`) hook the layers.
    _can_record_outputs = {
        "hidden_states": OutputRecorder(ZayaDecoderLayer, index=0),
        "router_logits": OutputRecorder(ZayaDecoderLayer, index=2),
    }

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        # Unless another is asked for, the reference experts ("eager"); transformers' default is "grouped_mm".
        return super().get_correct_experts_implementation(requested_experts or "eager")

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, ZayaRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, ZayaResidualScaling):
            init.ones_(module.hidden_states_scale)
            init.zeros_(module.hidden_states_bias)
            init.ones_(module.residual_scale)
            init.zeros_(module.residual_bias)
        elif isinstance(module, ZayaQKNorm):
            # Linear temperature: 0 would zero every key (uniform attention) at step 0.
            init.ones_(module.temp)
        elif isinstance(module, ZayaRouter):
            if module.use_eda:
                init.ones_(module.router_states_scale)
            biases = torch.zeros_like(module.balancing_biases)
            biases[-1] = self.config.balancing_bias_init_skip
            init.copy_(module.balancing_biases, biases)
        elif isinstance(module, ZayaExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, ZayaRotaryEmbedding):
            # Non-persistent buffer: after a meta-device load it holds garbage until recomputed here.
            init.copy_(module.inv_freq, module.compute_inv_freq())
        elif isinstance(module, ZayaModel):
            init.ones_(module.input_hidden_states_scale)
            init.zeros_(module.input_hidden_states_bias)


def document_lag_masks(
    position_ids: torch.Tensor, history: int, continues_cache: bool, dtype: torch.dtype
) -> torch.Tensor | None:
    """`masks[b, t, m] = 1` where token t may read token t-m (m = 0..history): its position is at least m (same
    document).

    `None` when no document starts inside the chunk (positions count up by one, and a chunk continuing a cache does
    not restart at 0): then the history the convolutions and value shift read is the sequence's own, zero-padded.
    """
    restarts = bool((position_ids[:, 1:] - position_ids[:, :-1] != 1).any())
    if not restarts and not (continues_cache and bool((position_ids[:, 0] == 0).any())):
        return None
    lags = torch.arange(history + 1, device=position_ids.device)
    return (position_ids[..., None] >= lags).to(dtype)


class ZayaModel(ZayaPreTrainedModel):
    def __init__(self, config: ZayaConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.input_hidden_states_scale = nn.Parameter(torch.ones(config.hidden_size))
        self.input_hidden_states_bias = nn.Parameter(torch.zeros(config.hidden_size))
        self.layers = nn.ModuleList(ZayaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ZayaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = ZayaRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.routed_token_counter: RoutedTokenCounter | None = None  # set by `RoutedTokenCounter.install`
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        if not isinstance(value, nn.Embedding):
            raise TypeError(f"ZAYA's input embeddings are an nn.Embedding, not {type(value).__name__}")
        self.embed_tokens = value

    def decoder_layers(self) -> list[ZayaDecoderLayer]:
        """`self.layers`, typed as what they hold (an `nn.ModuleList` is typed as holding any module)."""
        layers = []
        for layer in self.layers:
            if not isinstance(layer, ZayaDecoderLayer):
                raise TypeError(f"ZayaModel.layers holds a {type(layer).__name__}")
            layers.append(layer)
        return layers

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: ZayaCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> MoeModelOutputWithPast:
        """`use_cache` defaults to the config's (`merge_with_config_defaults`); `output_hidden_states` and
        `output_router_logits` are served by `capture_outputs`, which records them from the layers' outputs."""
        attention_kwargs = kernel_kwargs(kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
        if past_key_values is not None and not isinstance(past_key_values, ZayaCache):
            raise TypeError(f"ZAYA needs a `ZayaCache` (KV + CCA state), got {type(past_key_values).__name__}.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        dtype = inputs_embeds.dtype
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + inputs_embeds.shape[1], device=inputs_embeds.device)
        position_ids = position_ids.expand(inputs_embeds.shape[0], -1)

        causal_mask = self.causal_mask(inputs_embeds, attention_mask, past_key_values, position_ids)
        padding_mask = input_padding_mask(attention_mask, inputs_embeds)
        lag_masks = document_lag_masks(position_ids, self.cca_history, past_length > 0, dtype)
        if use_cache and past_key_values is None:
            past_key_values = ZayaCache(self.config)

        position_embeddings = self.rotary_emb(position_ids, dtype)
        residual = (inputs_embeds + self.input_hidden_states_bias) * self.input_hidden_states_scale
        residual = residual.to(torch.float32 if self.config.residual_in_fp32 else dtype)
        router_states = None
        for layer in self.layers:
            residual, router_states, _, _ = layer(
                residual, router_states, position_embeddings, causal_mask, lag_masks, past_key_values, padding_mask,
                **attention_kwargs,
            )  # fmt: skip
        return MoeModelOutputWithPast(
            last_hidden_state=self.norm(residual.to(dtype)),
            past_key_values=past_key_values if use_cache else None,
        )

    @property
    def cca_history(self) -> int:
        """Tokens before each token that CCA reads (the convolutions' history; at least 1, for the value shift)."""
        return max(self.config.cca_time0 + self.config.cca_time1 - 2, 1)

    def causal_mask(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: ZayaCache | None,
        position_ids: torch.Tensor,
    ) -> torch.Tensor | BlockMask | None:
        """The attention mask for the attention kernel of `config._attn_implementation`."""
        decoding = inputs_embeds.shape[1] == 1 and past_key_values is not None and past_key_values.get_seq_length() > 0
        if decoding and self.config._attn_implementation in ("sdpa", "eager"):
            # One query sees every cached key; only padding needs masking.
            if attention_mask is None or attention_mask.dim() != 2 or bool(attention_mask.all()):
                return None
            return attention_mask[:, None, None, :].bool()
        return create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )


def kernel_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What of a model forward's `**kwargs` reaches the layers: attention-kernel arguments. The `output_*` flags were
    read by `capture_outputs` (PEFT and `generate` pass `output_attentions=False` or None)."""
    if kwargs.get("output_attentions"):
        raise ValueError("ZAYA does not return attention weights (`output_attentions=True`).")
    return {name: value for name, value in kwargs.items() if name not in OUTPUT_FLAGS}


def input_padding_mask(attention_mask: torch.Tensor | None, inputs_embeds: torch.Tensor) -> torch.Tensor | None:
    """[batch, seq, 1] zeros at the padded tokens of a chunk of several tokens (a prompt), to zero their inputs
    before the convolutions and the value shift read them; None when nothing is padded (or for one token)."""
    seq = inputs_embeds.shape[1]
    if attention_mask is None or attention_mask.dim() != 2 or seq == 1:
        return None
    local_mask = attention_mask[:, -seq:]
    return None if bool(local_mask.all()) else local_mask.to(inputs_embeds.dtype)[..., None]


class ZayaForCausalLM(ZayaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: ZayaConfig):
        super().__init__(config)
        self.model = ZayaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # ZAYA needs its own cache (KV + CCA state); the model creates a `ZayaCache` on the first forward.
        return False

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: ZayaCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        skip_logits: bool = False,
        **kwargs: Any,
    ) -> MoeCausalLMOutputWithPast:
        """`skip_logits=True` with `labels` (training): the LM head runs only where a label is trained and `logits`
        is None. Same loss and gradients; with assistant-only labels most of the head's FLOPs and memory go."""
        if skip_logits and labels is None:
            raise ValueError("`skip_logits=True` needs `labels`: without them there is nothing to compute.")
        loss_kwargs = {name: kwargs.pop(name) for name in LOSS_KWARGS if name in kwargs}
        # An `output_*` flag given as None (PEFT passes them so) means the config's value, as when it is left out.
        model_kwargs = {name: value for name, value in kwargs.items() if value is not None or name not in OUTPUT_FLAGS}
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **model_kwargs,
        )
        hidden_states = outputs.last_hidden_state
        logits = loss = None
        if skip_logits and labels is not None:  # labels are present whenever skip_logits is (checked above)
            loss = self._loss_at_trained_positions(hidden_states, labels, loss_kwargs)
        else:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden_states[:, keep, :])
            if labels is not None:
                loss = self.loss_function(logits, labels, self.vocab_size, **loss_kwargs)
        return MoeCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            router_logits=outputs.router_logits,
        )

    def _loss_at_trained_positions(self, hidden_states: torch.Tensor, labels: torch.Tensor, loss_kwargs: dict):
        """The causal-LM loss with the LM head applied only to positions whose next-token label is trained."""
        ignore_index = loss_kwargs.get("ignore_index", -100)
        targets = loss_kwargs.pop("shift_labels", None)
        if targets is None:
            targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        trained = targets != ignore_index
        logits = self.lm_head(hidden_states[trained])
        return self.loss_function(logits, None, self.vocab_size, shift_labels=targets[trained], **loss_kwargs)


class RoutedTokenCounter:
    """Counts the real tokens each router sends to each class in training forwards, into `routed_token_counts`
    (what the balancing-bias update reads), through hooks on every `ZayaModel` inside `model`.

    A pre-hook on the model keeps the call's 2-D attention mask (padding is not counted) and whether it trains; a
    hook on each decoder layer counts the layer's chosen classes while the model's forward runs, so a layer that
    gradient checkpointing recomputes in the backward pass is not counted twice. The layers are hooked rather than
    their routers: with compiled layers (`zaya_model.cpu.compiled_layers`) a router runs inside a compiled graph,
    which leaves out any hook added after it was traced, while the layer itself is always called eagerly. A model
    that already has a counter keeps it (`install` returns it).
    """

    def __init__(self) -> None:
        self.models: list[ZayaModel] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.counting = False
        self.token_mask: torch.Tensor | None = None

    @classmethod
    def install(cls, model: nn.Module) -> RoutedTokenCounter:
        counter = cls()
        for inner in model.modules():
            if not isinstance(inner, ZayaModel):
                continue
            if inner.routed_token_counter is not None:
                return inner.routed_token_counter
            inner.routed_token_counter = counter
            counter.models.append(inner)
            counter.handles.append(inner.register_forward_pre_hook(counter._start, with_kwargs=True))
            counter.handles.append(inner.register_forward_hook(counter._stop, always_call=True))
            counter.handles.extend(layer.register_forward_hook(counter._count) for layer in inner.decoder_layers())
        if not counter.models:
            raise ValueError(f"{type(model).__name__} holds no ZAYA model to count the routing of.")
        return counter

    def remove(self) -> None:
        """Unhook the models (counts gathered so far stay with their routers)."""
        for handle in self.handles:
            handle.remove()
        for model in self.models:
            model.routed_token_counter = None
        self.models, self.handles = [], []

    def _start(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        self.counting = model.training
        self.token_mask = mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _stop(self, model: nn.Module, args: tuple, output: Any) -> None:
        self.counting, self.token_mask = False, None

    @torch.no_grad()
    def _count(self, layer: nn.Module, args: tuple, output: tuple[torch.Tensor, ...]) -> None:
        if not self.counting or not isinstance(layer, ZayaDecoderLayer):
            return
        choice = output[3]  # [batch, seq]
        if self.token_mask is not None:
            choice = choice[self.token_mask[:, -choice.shape[1] :]]
        router = layer.mlp.gate
        counts = torch.bincount(choice.reshape(-1), minlength=router.num_experts + 1).to(torch.float32)
        previous = router.routed_token_counts
        router.routed_token_counts = counts if previous is None else previous + counts


def count_parameters(model: ZayaForCausalLM) -> dict[str, int]:
    """Total, non-embedding and active (per token, non-embedding) parameter counts; works on the meta device."""
    config = model.config
    total = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    embedding = model.model.embed_tokens.weight.numel()
    if not config.tie_word_embeddings:
        embedding += model.lm_head.weight.numel()
    expert_params = sum(
        layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel() for layer in model.model.layers
    )
    active_experts = math.ceil(expert_params * config.num_experts_per_tok / config.num_experts)
    active = total - embedding - expert_params + active_experts
    return {"total": total, "non_embedding": total - embedding, "active_non_embedding": active}


__all__ = ["ZayaPreTrainedModel", "ZayaModel", "ZayaForCausalLM", "RoutedTokenCounter", "count_parameters"]
