"""ZAYA1 configuration.

Field names follow the upstream `transformers` `zaya` config, so a `config.json` we write loads in stock transformers
and theirs loads here. Our additions (`skip_expert_mode`, `router_rms_norm_eps`, `residual_in_fp32`) default to the
upstream behaviour; `ZayaConfig.zaya1_base()` sets them to Zyphra's ZAYA1-base values.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

SKIP_EXPERT_MODES = ("zero", "scaled_input")
# The field that marks Zyphra's legacy ZAYA1-base config (its per-sub-layer plan); `zaya_model.legacy_layout` converts.
LEGACY_LAYERS_FIELD = "zaya_layers"
LEGACY_CONVERSION_COMMAND = "python -m zaya_model.legacy_layout LEGACY_DIR OUTPUT_DIR"


class ZayaConfig(PreTrainedConfig):
    r"""
    Configuration of a ZAYA1 model: Compressed Convolutional Attention + top-1 MoE with the ZAYA router.

    One "layer" (block) is an attention half followed by an MoE half, as in the upstream layout.

    Args beyond the usual decoder fields:
        head_dim: width of each attention head; q width is `num_attention_heads * head_dim` (compressed vs hidden).
        moe_intermediate_size: SwiGLU width of one expert (`gate_up_proj` holds 2x this).
        num_experts: routed experts; the router has one more class, the "skip" class.
        router_hidden_size: width of the router's down-projection and MLP.
        cca_time0, cca_time1: kernel sizes of CCA's depthwise and grouped causal convolutions.
        skip_expert_mode: what a token routed to the skip class outputs: `"zero"` (upstream) or `"scaled_input"`
            (ZAYA1-base: the MoE input scaled by the skip probability).
        router_rms_norm_eps: epsilon of the router's RMSNorm; `None` uses `rms_norm_eps`.
        residual_in_fp32: keep the residual stream in fp32 (upstream does); ZAYA1-base used the model dtype.
        balancing_bias_init_skip: initial balancing bias of the skip class (so it is rarely chosen at init).
    """

    model_type = "zaya"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 262272
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    tie_word_embeddings: bool = True
    rope_parameters: dict | None = None
    sliding_window: int | None = None
    attention_dropout: float | int = 0.0
    attention_bias: bool = False
    lm_head_bias: bool = False
    moe_intermediate_size: int = 2048
    num_experts: int = 16
    num_experts_per_tok: int = 1
    output_router_logits: bool = False
    router_hidden_size: int = 256
    cca_time0: int = 2
    cca_time1: int = 2
    layer_types: list[str] | None = None
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 106

    skip_expert_mode: str = "zero"
    router_rms_norm_eps: float | None = None
    residual_in_fp32: bool = True
    balancing_bias_init_skip: float = -1.0

    def __post_init__(self, **kwargs):
        if LEGACY_LAYERS_FIELD in kwargs:
            raise ValueError(
                f"This is a config of Zyphra's legacy ZAYA1-base checkpoint layout (it has `{LEGACY_LAYERS_FIELD}`), "
                f"which ZAYA models do not load: convert the checkpoint first with `{LEGACY_CONVERSION_COMMAND}`."
            )
        if self.layer_types is None:
            self.layer_types = ["hybrid"] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        if self.rope_parameters is None:
            self.rope_parameters = {
                "hybrid": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5}
            }
        elif "rope_theta" in self.rope_parameters:
            # A flat dict (one rope for every layer) is normalised to the upstream per-layer-type form.
            self.rope_parameters = {"hybrid": dict(self.rope_parameters)}
        self.rope_parameters = {k: dict(v) for k, v in self.rope_parameters.items()}
        for params in self.rope_parameters.values():
            params.setdefault("rope_type", "default")
        super().__post_init__(**kwargs, ignore_keys_at_rope_validation={"hybrid", "hybrid_sliding"})
        self.validate_architecture()

    def convert_rope_params_to_dict(self, **kwargs):
        return kwargs

    def validate_architecture(self):
        if self.num_experts_per_tok != 1:
            raise ValueError("ZAYA routes each token to exactly one expert: `num_experts_per_tok` must be 1.")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError("`num_attention_heads` must be a multiple of `num_key_value_heads`.")
        if self.skip_expert_mode not in SKIP_EXPERT_MODES:
            raise ValueError(f"`skip_expert_mode` must be one of {SKIP_EXPERT_MODES}, got {self.skip_expert_mode!r}.")
        if self.cca_time0 < 1 or self.cca_time1 < 1:
            kernels = f"cca_time0={self.cca_time0}, cca_time1={self.cca_time1}"
            raise ValueError(f"CCA kernel sizes must be >= 1, got {kernels}.")
        layer_types = self.layer_types or []  # `__post_init__` fills them when not given
        if set(layer_types) != {"hybrid"}:
            raise ValueError("Only `hybrid` (full causal attention + MoE) layers are supported.")
        if len(layer_types) != self.num_hidden_layers:
            raise ValueError("`layer_types` must have one entry per layer.")

    @property
    def hybrid_rope_parameters(self) -> dict:
        """The rope parameters of the one layer type (`__post_init__` fills them when not given)."""
        if self.rope_parameters is None:
            raise ValueError("`rope_parameters` is not set")
        return self.rope_parameters["hybrid"]

    @property
    def rope_theta(self) -> float:
        return float(self.hybrid_rope_parameters["rope_theta"])

    @property
    def partial_rotary_factor(self) -> float:
        return float(self.hybrid_rope_parameters.get("partial_rotary_factor", 1.0))

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (the first ones); the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    # Widths every implementation (HF, the CPU decode steps, the vLLM plugin, adapter checks) derives from the config.
    @property
    def query_width(self) -> int:
        """A layer's query channels, all heads."""
        return self.num_attention_heads * self.head_dim

    @property
    def key_width(self) -> int:
        """A layer's key channels, all key-value heads; the values have as many, half current and half delayed."""
        return self.num_key_value_heads * self.head_dim

    @property
    def cca_channels(self) -> int:
        """The channels CCA's convolutions mix: queries and keys."""
        return self.query_width + self.key_width

    @property
    def cca_history(self) -> int:
        """Tokens of history CCA's two convolutions read together (a kernel of size k looks k-1 steps back)."""
        return self.cca_time0 + self.cca_time1 - 2

    @property
    def router_norm_eps(self) -> float:
        return self.rms_norm_eps if self.router_rms_norm_eps is None else self.router_rms_norm_eps

    @classmethod
    def zaya1_base(cls, **overrides: Any) -> ZayaConfig:
        """Zyphra's ZAYA1-base (8.3B total, ~760M active): 40 CCA+MoE blocks, 16 experts + skip, top-1."""
        values: dict[str, Any] = {
            "vocab_size": 262272,
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "moe_intermediate_size": 2048,
            "num_experts": 16,
            "router_hidden_size": 256,
            "max_position_embeddings": 32768,
            "rope_parameters": {
                "hybrid": {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5}
            },
            "rms_norm_eps": 1e-5,
            "pad_token_id": 0,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "tie_word_embeddings": True,
            "skip_expert_mode": "scaled_input",
            "router_rms_norm_eps": 1e-6,
            "residual_in_fp32": False,
        }
        values.update(overrides)
        return cls(**values)


__all__ = ["ZayaConfig", "SKIP_EXPERT_MODES", "LEGACY_LAYERS_FIELD", "LEGACY_CONVERSION_COMMAND"]
