"""CCA's q/k/v as a vLLM state-space layer: projections, two causal convolutions, q-k mean skip, value shift.

Per request and layer, vLLM keeps one state tensor in its state-space ("mamba") cache, the same state as
`zaya_model.cache_zaya` in one piece: `[history, channels + delayed_value_width]`, the last
`cca_time0 + cca_time1 - 2` inputs of the layer (oldest first), each the raw q‖k projection (what the convolutions
read) followed by `v_proj_delayed(x)` (the newest row's is the next token's shifted value).

A batch arrives as decode tokens first, then prefill chunks; each request has a state slot and (for prefills) a flag
saying whether its state holds earlier tokens (a continued chunk) or must start from zeros. Only reading and writing
that state depends on the batch's layout, so only that is a custom op (`zaya_cca_state`): it hands back each token's
window, its inputs at lags history..0, gathered over a per-token lag table without a loop over requests; a batch of
decodes only (the steady state of serving) reads each request's window straight from its state slot. The
projections (one matmul for all four), convolutions (`convolve_receptive_fields`, shared with
`zaya_model.modeling_zaya`) and the q-k skip stay in the graph that vLLM compiles.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import CacheConfig, ModelConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import MergedColumnParallelLinear
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ..configuration_zaya import ZayaConfig
from ..modeling_zaya import convolve_receptive_fields


def cca_state_shapes(config: ZayaConfig) -> tuple[tuple[int, int]]:
    """The state's shape for one layer and request: `history` rows of q‖k and the delayed value."""
    return ((cca_history(config), config.cca_channels + config.key_width // 2),)


def cca_history(config: ZayaConfig) -> int:
    history = config.cca_history
    if history < 1:
        raise ValueError("the vLLM plugin needs cca_time0 + cca_time1 >= 3 (a convolution that reads history)")
    return history


def cca_state_dtypes(model_dtype, mamba_cache_dtype) -> tuple[torch.dtype]:
    # `--mamba-cache-dtype` sets the state's dtype ("auto" follows the model dtype).
    return MambaStateDtypeCalculator.short_conv_state_dtype(model_dtype, mamba_cache_dtype)


class _ConvWeights(nn.Module):
    """Holds a `Conv1d`'s weight `[out, in/groups, kernel]` and bias under the checkpoint's names."""

    def __init__(self, channels: int, group_width: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, group_width, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False)


class ZayaCCAProjection(MambaBase, nn.Module):
    """Computes CCA's query, key and value `[tokens, q_width + 2 * kv_width]` and advances the per-request state."""

    # The four projections read the same input, so they run as one matmul: `fused_proj` holds the checkpoint's
    # q_proj, k_proj, v_proj_delayed and v_proj_current stacked in this order (LoRA adapters on any of them apply
    # to their slice: the model's `packed_modules_mapping`). The first three are a state row, so a row of the
    # fused output's first columns is that row without a copy.
    projections = ("q_proj", "k_proj", "v_proj_delayed", "v_proj_current")

    def __init__(
        self,
        config: ZayaConfig,
        model_config: ModelConfig | None = None,
        cache_config: CacheConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.config = config
        self.model_config = model_config
        self.cache_config = cache_config
        self.prefix = prefix
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        ((self.history, self.state_width),) = cca_state_shapes(config)  # a state row: q‖k‖delayed value
        self.query_width = config.query_width
        self.key_width = config.key_width
        self.channels = config.cca_channels
        half_value = self.key_width // 2
        self.output_widths = (self.query_width, self.key_width, half_value, half_value)
        self.fused_proj = MergedColumnParallelLinear(
            config.hidden_size,
            list(self.output_widths),
            bias=config.attention_bias,
            prefix=f"{prefix}.fused_proj",
            disable_tp=True,
        )
        groups = self.num_heads + self.num_kv_heads  # one per query and key head
        self.conv_qk_depthwise = _ConvWeights(self.channels, 1, config.cca_time0)
        self.conv_qk_grouped = _ConvWeights(self.channels, self.channels // groups, config.cca_time1)

        compilation_config = get_current_vllm_config().compilation_config
        if prefix in compilation_config.static_forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        compilation_config.static_forward_context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    # --- vLLM state-space contract -------------------------------------------------------------------------------
    def get_state_shape(self) -> tuple[tuple[int, int]]:
        return cca_state_shapes(self.config)

    def get_state_dtype(self) -> tuple[torch.dtype]:
        if self.model_config is None or self.cache_config is None:
            raise ValueError(f"{self.prefix}: the state's dtype needs the model and cache configs")
        return cca_state_dtypes(self.model_config.dtype, self.cache_config.mamba_cache_dtype)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # Same metadata as a short convolution: state slots, prefill offsets, has-initial-state flags.
        return MambaAttentionBackendEnum.SHORT_CONV

    # --- forward ---------------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """q‖k‖v `[tokens, q_width + 2 * kv_width]`. Only the state's read and update are a custom op
        (`zaya_cca_state`): the projections, convolutions and q-k skip stay in the graph vLLM compiles."""
        projected, _ = self.fused_proj(hidden_states)
        queries, keys, _, current = projected.split(self.output_widths, dim=-1)
        inputs = projected[:, : self.state_width]  # q‖k‖delayed value: one state row
        tokens = inputs.shape[0]
        windows = torch.ops.vllm.zaya_cca_state(inputs, self.history, self.prefix)
        fields = windows[:, :, : self.channels].transpose(1, 2)
        convolved = convolve_receptive_fields(fields, self.conv_qk_depthwise, self.conv_qk_grouped)
        delayed_before = windows[:, self.history - 1, self.channels :]  # the previous token's delayed value

        # q-k mean skip on the pre-convolution projections: q_h += (q_h + k_g(h)) / 2, k_g += (mean q_g + k_g) / 2.
        groups = self.num_heads // self.num_kv_heads
        grouped_queries = queries.reshape(tokens, self.num_kv_heads, groups, self.head_dim)
        query_skip = (grouped_queries + keys.reshape(tokens, self.num_kv_heads, 1, self.head_dim)) * 0.5
        query = convolved[:, : self.query_width] + query_skip.reshape(tokens, self.query_width)
        key = convolved[:, self.query_width :] + query_skip.mean(dim=2).reshape(tokens, self.key_width)
        return torch.cat((query, key, current, delayed_before), dim=-1)

    def read_and_advance_state(self, inputs: torch.Tensor, step_metadata) -> torch.Tensor:
        """`advance_state` on this layer's state; `step_metadata` is the forward context's `attn_metadata`."""
        metadata = step_metadata.get(self.prefix) if isinstance(step_metadata, dict) else None
        return advance_state(self.kv_cache[0] if metadata is not None else None, self.history, metadata, inputs)


def advance_state(state: torch.Tensor | None, history: int, metadata, inputs: torch.Tensor) -> torch.Tensor:
    """Each token's window `[tokens, history + 1, width]`: its layer inputs (state rows) at lags history..0, reading
    before a request's first token from its state slot; each request's last `history` inputs become its new state.
    `metadata` is the layer's state-space metadata (None in vLLM's profile run, which has no state)."""
    if state is None or metadata is None:
        windows = _profile_windows(history, inputs)
    elif metadata.num_prefills == 0:
        windows = _decode_windows(state, metadata, inputs)
    else:
        windows = _general_windows(state, history, metadata, inputs)
    if windows.shape[0] < inputs.shape[0]:
        # CUDA graphs may pad the batch: only the first rows are real; the rest must stay finite.
        padding = windows.new_zeros(inputs.shape[0] - windows.shape[0], *windows.shape[1:])
        windows = torch.cat((windows, padding))
    return windows


def _decode_windows(state: torch.Tensor, metadata, inputs: torch.Tensor) -> torch.Tensor:
    """Every request decodes one token and has state: a token's window is its request's state plus itself.
    This is the steady state of serving, so it is kept to a few tensor ops."""
    slots = _decode_slots(metadata)
    # index_select / index_copy_: much cheaper per call than advanced indexing for a few rows.
    history = state.index_select(0, slots).to(inputs.dtype)
    windows = torch.cat((history, inputs[: slots.shape[0]].unsqueeze(1)), dim=1)
    state.index_copy_(0, slots, windows[:, 1:].to(state.dtype))
    return windows


def _general_windows(state: torch.Tensor, history: int, metadata, inputs: torch.Tensor) -> torch.Tensor:
    """Any batch: decodes and prefill chunks, fresh or continued (vLLM's order)."""
    requests = _RequestLayout.for_step(metadata, inputs.device)
    fresh = ~requests.has_initial_state
    # Slots of fresh requests may hold a finished request's state (or garbage): read zeros instead.
    histories = state.index_select(0, requests.slots).to(inputs.dtype).masked_fill(fresh[:, None, None], 0.0)
    frames = _frames(histories, requests, inputs)
    tails = _gather_rows(frames, requests.tail_index(history))
    state.index_copy_(0, requests.slots, tails.to(state.dtype))
    return _gather_rows(frames, requests.window_index(history))


def _profile_windows(history: int, inputs: torch.Tensor) -> torch.Tensor:
    """vLLM's profile run: no state exists yet; the batch is one fresh sequence (its values are not used)."""
    requests = _RequestLayout.single(inputs.shape[0], inputs.device)
    histories = inputs.new_zeros(1, history, inputs.shape[-1])
    return _gather_rows(_frames(histories, requests, inputs), requests.window_index(history))


def _frames(histories: torch.Tensor, requests: _RequestLayout, inputs: torch.Tensor) -> torch.Tensor:
    """Every request's history rows, then the batch's tokens: a window index reaches into a request's history rows
    for lags before its first token."""
    return torch.cat((histories.reshape(-1, inputs.shape[-1]), inputs[: requests.num_tokens]))


def _gather_rows(frames: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`frames[index]` for a 2-D index, as one `index_select` (cheaper per call than advanced indexing)."""
    return frames.index_select(0, index.reshape(-1)).view(*index.shape, frames.shape[-1])


# What was derived from the step being run, by kind, with the metadata it came from: every CCA layer of a step sees
# the same metadata object, so these are built once per step, not once per layer.
_step_derived: dict[str, tuple[object, object]] = {}


def _once_per_step(kind: str, metadata, build):
    derived = _step_derived.get(kind)
    if derived is None or derived[0] is not metadata:
        _step_derived[kind] = derived = (metadata, build())
    return derived[1]


def _decode_slots(metadata) -> torch.Tensor:
    """The decoding requests' state slots as an index tensor."""

    def build() -> torch.Tensor:
        slots = metadata.state_indices_tensor_d
        return (slots[:, 0] if slots.dim() > 1 else slots)[: metadata.num_decode_tokens].long()

    return _once_per_step("decode_slots", metadata, build)


class _RequestLayout:
    """Where each request's tokens sit in the flat batch, its state slot, and lag/tail gather indices.

    Frames are indexed as `[histories of all requests (R * h rows), tokens of the batch]`, so a lag that reaches
    before a request's first token lands in that request's history rows.
    """

    def __init__(self, starts: torch.Tensor, lengths: torch.Tensor, num_tokens: int, slots, has_initial_state):
        # `num_tokens` (= lengths.sum()) comes from the host-side metadata: reading it off the device would
        # synchronise with the GPU in every layer. Nothing here reads a device tensor's value on the host.
        self._indices: dict[tuple, torch.Tensor] = {}
        self.starts, self.lengths = starts, lengths
        self.slots, self.has_initial_state = slots, has_initial_state
        self.num_requests = lengths.shape[0]
        self.num_tokens = num_tokens
        requests = torch.arange(self.num_requests, device=lengths.device)
        self.request = torch.repeat_interleave(requests, lengths, output_size=num_tokens)
        self.position = torch.arange(num_tokens, device=lengths.device) - starts.index_select(0, self.request)

    @classmethod
    def single(cls, tokens: int, device) -> _RequestLayout:
        zero = torch.zeros(1, dtype=torch.long, device=device)
        return cls(zero, torch.full((1,), tokens, device=device), tokens, None, None)

    @classmethod
    def for_step(cls, metadata, device) -> _RequestLayout:
        """The step's layout, built once per step: every CCA layer of a step sees the same batch."""
        return _once_per_step("layout", metadata, lambda: cls.from_metadata(metadata, device))

    @classmethod
    def from_metadata(cls, metadata, device) -> _RequestLayout:
        """Decodes (one token each) first, then prefill chunks, as vLLM orders the batch."""
        num_decodes, num_prefills = metadata.num_decode_tokens, metadata.num_prefills
        length_parts: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        initial: list[torch.Tensor] = []
        if num_decodes:
            decode_slots = metadata.state_indices_tensor_d
            slots.append((decode_slots[:, 0] if decode_slots.dim() > 1 else decode_slots)[:num_decodes])
            length_parts.append(torch.ones(num_decodes, dtype=torch.long, device=device))
            initial.append(torch.ones(num_decodes, dtype=torch.bool, device=device))
        if num_prefills:
            prefill_slots = metadata.state_indices_tensor_p
            slots.append((prefill_slots[:, 0] if prefill_slots.dim() > 1 else prefill_slots)[:num_prefills])
            length_parts.append(torch.diff(metadata.query_start_loc_p[: num_prefills + 1]).long())
            initial.append(metadata.has_initial_states_p[:num_prefills].bool())
        lengths = torch.cat(length_parts)
        starts = torch.cumsum(lengths, 0) - lengths
        num_tokens = num_decodes + (metadata.num_prefill_tokens if num_prefills else 0)
        return cls(starts, lengths, num_tokens, torch.cat(slots).long(), torch.cat(initial))

    def window_index(self, history: int) -> torch.Tensor:
        """[tokens, history + 1]: rows in the frames of each token's inputs at lags history..0 (oldest first)."""
        key = ("window", history)
        if key not in self._indices:
            lags = [self._lag_index(lag, history) for lag in range(history, -1, -1)]
            self._indices[key] = torch.stack(lags, dim=1)
        return self._indices[key]

    def _lag_index(self, lag: int, history: int) -> torch.Tensor:
        """Row in the frames of each token's input `lag` steps back (history rows when before the request start)."""
        token = torch.arange(self.num_tokens, device=self.position.device)
        in_batch = self.num_requests * history + token - lag
        in_history = self.request * history + history - (lag - self.position)
        return torch.where(self.position >= lag, in_batch, in_history)

    def tail_index(self, history: int) -> torch.Tensor:
        """Rows of the frames that become each request's new conv state: its last `history` inputs, oldest first."""
        key = ("tail", history)
        if key not in self._indices:
            self._indices[key] = self._tail_index(history)
        return self._indices[key]

    def _tail_index(self, history: int) -> torch.Tensor:
        back = torch.arange(history, 0, -1, device=self.lengths.device)  # history ... 1 steps before the end
        offset = self.lengths[:, None] - back  # position within the request; negative reaches into its history
        requests = torch.arange(self.num_requests, device=self.lengths.device)[:, None]
        in_batch = self.num_requests * history + self.starts[:, None] + offset
        in_history = requests * history + history + offset
        return torch.where(offset >= 0, in_batch, in_history)


@eager_break_during_capture
def zaya_cca_state(inputs: torch.Tensor, history: int, layer_name: str) -> torch.Tensor:
    context = get_forward_context()
    return context.no_compile_layers[layer_name].read_and_advance_state(inputs, context.attn_metadata)


def zaya_cca_state_fake(inputs: torch.Tensor, history: int, layer_name: str) -> torch.Tensor:
    return inputs.new_empty(inputs.shape[0], history + 1, inputs.shape[-1])


direct_register_custom_op(op_name="zaya_cca_state", op_func=zaya_cca_state, fake_impl=zaya_cca_state_fake)
