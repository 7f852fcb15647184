"""The `generate()` cache of ZAYA1: per attention layer a KV cache plus CCA's constant-size state.

CCA keeps, besides keys and values, two pieces of per-sequence state (spec §3.8):
- the conv state: the last `cca_time0 + cca_time1 - 2` raw packed q/k projections, so the two causal convolutions can
  run one token at a time;
- the value-shift state: the delayed value projection of the previous token (`v_proj_delayed(x_{t-1})`).

Keys and values live in a buffer that grows by doubling, so a decode step writes one slot instead of concatenating
(and copying) the whole cache as a plain `DynamicCache` does.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class ZayaCacheLayer(CacheLayerMixin):
    """Keys/values `[batch, kv_heads, capacity, head_dim]` (first `length` slots used) plus the CCA state."""

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.length = 0
        self.conv_state: torch.Tensor | None = None  # [batch, history, conv_channels]
        self.shift_state: torch.Tensor | None = None  # [batch, delayed_value_width]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _buffers(
        self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers, first grown (at least doubled) when they hold fewer than `needed` slots."""
        capacity = self.capacity()
        if self.keys is not None and self.values is not None and needed <= capacity:
            return self.keys, self.values
        new_capacity = max(needed, 2 * capacity, 64)
        batch, heads, _, head_dim = key_states.shape
        keys = key_states.new_empty(batch, heads, new_capacity, head_dim)
        values = value_states.new_empty(batch, heads, new_capacity, value_states.shape[-1])
        if self.keys is not None and self.values is not None and self.length:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values
        return keys, values

    def capacity(self) -> int:
        """Key/value slots allocated (filled or not)."""
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_length = self.length + key_states.shape[-2]
        keys, values = self._buffers(key_states, value_states, new_length)
        keys[:, :, self.length : new_length] = key_states
        values[:, :, self.length : new_length] = value_states
        self.length = new_length
        return keys[:, :, :new_length], values[:, :, :new_length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.conv_state = self.shift_state = None
        self.length = 0
        self.is_initialized = False

    def _select_batch(self, index: torch.Tensor) -> None:
        if self.keys is not None and self.values is not None:
            self.keys = self.keys.index_select(0, index.to(self.keys.device))
            self.values = self.values.index_select(0, index.to(self.values.device))
        if self.conv_state is not None and self.shift_state is not None:
            self.conv_state = self.conv_state.index_select(0, index.to(self.conv_state.device))
            self.shift_state = self.shift_state.index_select(0, index.to(self.shift_state.device))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self._select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        filled = self.keys if self.keys is not None else self.conv_state
        if filled is None:
            return
        self._select_batch(torch.arange(filled.shape[0], device=filled.device).repeat_interleave(repeats))


class ZayaCache(Cache):
    """One `ZayaCacheLayer` per ZAYA block, created by the model on the first forward with `use_cache=True`."""

    # transformers types `Cache.layers` as its own layer classes; a ZayaCache holds only `ZayaCacheLayer`s.
    layers: list[ZayaCacheLayer]  # type: ignore[assignment]

    def __init__(self, config=None, num_layers: int | None = None):
        num_layers = config.num_hidden_layers if num_layers is None else num_layers
        super().__init__(layers=[ZayaCacheLayer() for _ in range(num_layers)])

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        layer = self.layers[0 if layer_idx is None else layer_idx]
        return layer.conv_state is not None

    def cca_state(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's conv and value-shift state, None before its first chunk."""
        layer = self.layers[layer_idx]
        if layer.conv_state is None or layer.shift_state is None:
            return None
        return layer.conv_state, layer.shift_state

    def update_cca_state(self, layer_idx: int, conv_state: torch.Tensor, shift_state: torch.Tensor) -> None:
        layer = self.layers[layer_idx]
        layer.conv_state, layer.shift_state = conv_state, shift_state


__all__ = ["ZayaCache", "ZayaCacheLayer"]
