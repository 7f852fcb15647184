"""Zyphra's legacy ZAYA1-base checkpoint layout <-> the upstream `zaya` layout (`zaya_model.legacy_layout`)."""

import json
import subprocess
import sys

import pytest
import torch
import transformers

from zaya_model import ZayaConfig, ZayaForCausalLM, legacy_layout
from zaya_model.legacy_layout import (
    is_legacy_config,
    legacy_config_to_upstream,
    legacy_state_dict_to_upstream,
    load_legacy_checkpoint,
    save_legacy_checkpoint,
    upstream_config_to_legacy,
    upstream_state_dict_to_legacy,
)

TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "router_hidden_size": 16,
    "max_position_embeddings": 256,
}


def zaya1_base_legacy_config() -> dict:
    """ZAYA1-base's config.json as described in the architecture spec, section 1.2."""
    return {
        "model_type": "zaya",
        "architectures": ["ZayaForCausalLM"],
        "zaya_layers": ["a", 16] * 40,
        "num_hidden_layers": 80,
        "hidden_size": 2048,
        "cca": True,
        "cca_num_q_heads": [8, 0] * 40,
        "num_query_groups_list": [2, 0] * 40,
        "num_key_value_heads": 2,
        "num_attention_heads": 16,
        "kv_channels": 128,
        "ffn_hidden_size_list": [0, 4096] * 40,
        "zaya_mlp_expansion": [0, 256] * 40,
        "moe_router_topk": 1,
        "zaya_use_mod": True,
        "zaya_use_eda": True,
        "zaya_high_prec": True,
        "scale_residual_merge": True,
        "residual_in_fp32": False,
        "activation_func": "swiglu",
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "bias_activation_fusion": True,
        "attention_bias": False,
        "lm_head_bias": False,
        "normalization": "RMSNorm",
        "norm_epsilon": 1e-5,
        "vocab_size": 262272,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000,
        "partial_rotary_factor": 0.5,
        "rope_scaling": False,
        "max_position_embeddings": 32768,
    }


def random_model(model_class=ZayaForCausalLM, config_class=ZayaConfig, seed=0, **overrides):
    """A tiny model whose every tensor (scales, biases, temperatures, balancing biases too) holds distinct random
    values, so that any two tensors swapped by a conversion change the output."""
    model = model_class(config_class(**{**TINY, **overrides}))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5 + 0.5)
    return model.eval()


def assert_bit_exact(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


# --- config ----------------------------------------------------------------------------------------------------------


def test_is_legacy_config():
    assert is_legacy_config(zaya1_base_legacy_config())
    assert not is_legacy_config(ZayaConfig(**TINY).to_dict())


def test_zaya1_base_legacy_config_becomes_the_zaya1_base_preset():
    upstream = legacy_config_to_upstream(zaya1_base_legacy_config())

    assert upstream["num_hidden_layers"] == 40
    assert upstream["num_attention_heads"] == 8  # actual query heads, not the nominal 16
    assert upstream["num_key_value_heads"] == 2
    assert upstream["head_dim"] == 128
    assert upstream["moe_intermediate_size"] == 2048  # fc1 width 4096 holds gate and up
    assert upstream["num_experts"] == 16
    assert upstream["num_experts_per_tok"] == 1
    assert upstream["router_hidden_size"] == 256
    assert upstream["rms_norm_eps"] == 1e-5
    assert upstream["layer_types"] == ["hybrid"] * 40
    assert upstream["rope_parameters"] == {
        "hybrid": {"rope_type": "default", "rope_theta": 1_000_000, "partial_rotary_factor": 0.5}
    }
    assert upstream["skip_expert_mode"] == "scaled_input"
    assert upstream["router_rms_norm_eps"] == 1e-6
    assert upstream["residual_in_fp32"] is False
    assert "rope_scaling" not in upstream and "zaya_layers" not in upstream

    ours = ZayaConfig(**upstream).to_dict()
    preset = ZayaConfig.zaya1_base().to_dict()
    assert {k: v for k, v in ours.items() if k != "architectures"} == {
        k: v for k, v in preset.items() if k != "architectures"
    }
    # Stock transformers' strict validation accepts it too (the `rope_scaling: false` wart is gone).
    assert transformers.ZayaConfig(**upstream).num_hidden_layers == 40


def test_legacy_config_round_trip():
    legacy = zaya1_base_legacy_config()
    upstream = legacy_config_to_upstream(legacy)
    back = upstream_config_to_legacy(upstream)
    assert {k: back[k] for k in legacy.keys() & back.keys()} == {k: legacy[k] for k in legacy.keys() & back.keys()}
    assert legacy.keys() - back.keys() == {"bias_activation_fusion"}  # a kernel switch, not part of the model
    assert back.keys() - legacy.keys() == {"clamp_temp", "cca_time0", "cca_time1"}  # defaults written out
    assert legacy_config_to_upstream(back) == upstream


def test_upstream_config_round_trip_keeps_behaviour():
    original = ZayaConfig(**TINY, skip_expert_mode="zero", residual_in_fp32=True)
    back = ZayaConfig(**legacy_config_to_upstream(upstream_config_to_legacy(original.to_dict())))
    assert back.skip_expert_mode == "zero"
    assert back.residual_in_fp32 is True
    assert back.router_norm_eps == original.router_norm_eps == 1e-5
    skip = {"router_rms_norm_eps", "architectures"}  # None ("same as rms_norm_eps") comes back as the number
    assert {k: v for k, v in back.to_dict().items() if k not in skip} == {
        k: v for k, v in original.to_dict().items() if k not in skip
    }


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"zaya_layers": ["a", "a", 16, 16]}, "zaya_layers"),
        ({"zaya_layers": [16, "a"] * 40}, "zaya_layers"),
        ({"zaya_layers": ["a", 16] * 39 + ["a"]}, "zaya_layers"),
        ({"zaya_layers": ["a", 16] * 39 + ["a", 8]}, "zaya_layers"),
        ({"moe_router_topk": 2}, "moe_router_topk"),
        ({"zaya_use_mod": False}, "zaya_use_mod"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"cca_num_q_heads": [8, 0] * 39 + [4, 0]}, "cca_num_q_heads"),
        ({"ffn_hidden_size_list": [0, 4096] * 39}, "ffn_hidden_size_list"),
        ({"swa_layers": [4096, 0] * 40}, "swa_layers"),
    ],
)
def test_legacy_config_rejects_what_the_block_layout_cannot_hold(change, field):
    with pytest.raises(ValueError, match=field):
        legacy_config_to_upstream(zaya1_base_legacy_config() | change)


def test_upstream_config_rejects_sliding_layers():
    config = ZayaConfig(**TINY).to_dict() | {"layer_types": ["hybrid", "hybrid_sliding", "hybrid"]}
    with pytest.raises(ValueError, match="layer_types"):
        upstream_config_to_legacy(config)


# --- state dict ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_state_dict_round_trips_are_bit_exact(dtype, tie_word_embeddings):
    model = random_model(tie_word_embeddings=tie_word_embeddings).to(dtype)
    upstream = model.state_dict()
    if tie_word_embeddings:
        del upstream["lm_head.weight"]  # what save_pretrained writes
    else:
        assert not torch.equal(upstream["lm_head.weight"], upstream["model.embed_tokens.weight"])

    legacy = upstream_state_dict_to_legacy(upstream, 3)
    assert_bit_exact(legacy_state_dict_to_upstream(legacy, 3), upstream)
    assert_bit_exact(upstream_state_dict_to_legacy(legacy_state_dict_to_upstream(legacy, 3), 3), legacy)


def test_legacy_names_follow_the_spec():
    upstream = random_model(num_hidden_layers=2).state_dict()
    del upstream["lm_head.weight"]
    legacy = upstream_state_dict_to_legacy(upstream, 2)

    # Spec section 6, written out for 2 blocks = 4 sub-layers.
    expected = {"model.embed_tokens.weight", "model.final_norm.weight"}
    expected |= {f"model.layers.0.res_scale.hidden_states_{p}" for p in ("scale", "bias")}
    rs = ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias")
    expected |= {f"model.res_scale.{p}" for p in rs}
    for sub_layer in (0, 2):
        qkv = f"model.layers.{sub_layer}.self_attn.qkv."
        expected |= {f"{qkv}{p}.weight" for p in ("linear_q", "linear_k", "val_proj1", "val_proj2")}
        expected |= {f"{qkv}conv_qk.{i}.{p}" for i in (0, 1) for p in ("weight", "bias")}
        expected |= {f"{qkv}temp", f"model.layers.{sub_layer}.self_attn.o_proj.weight"}
        expected.add(f"model.layers.{sub_layer}.input_norm.weight")
    expected |= {f"model.layers.{sub_layer}.res_scale.{p}" for sub_layer in (1, 2, 3) for p in rs}
    for sub_layer in (1, 3):
        router = f"model.layers.{sub_layer}.zaya_block.router."
        expected |= {f"{router}down_proj.{p}" for p in ("weight", "bias")}
        expected |= {f"{router}router_mlp.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")}
        expected |= {f"{router}router_mlp.4.weight", f"{router}rmsnorm_eda.weight", f"{router}balancing_biases"}
        expected |= {
            f"model.layers.{sub_layer}.zaya_block.experts.local_experts.{e}.linear_fc{fc}.weight"
            for e in range(4)
            for fc in (1, 2)
        }
        expected.add(f"model.layers.{sub_layer}.input_norm.weight")
    expected.add("model.layers.3.zaya_block.router.router_states_scale")  # no EDA on the first MoE layer
    assert set(legacy) == expected

    same = {
        "model.layers.0.res_scale.hidden_states_scale": "model.input_hidden_states_scale",
        "model.layers.1.res_scale.residual_bias": "model.layers.0.post_attention_residual_scale.residual_bias",
        "model.layers.2.res_scale.residual_bias": "model.layers.0.post_mlp_residual_scale.residual_bias",
        "model.layers.3.res_scale.residual_scale": "model.layers.1.post_attention_residual_scale.residual_scale",
        "model.res_scale.residual_scale": "model.layers.1.post_mlp_residual_scale.residual_scale",
        "model.final_norm.weight": "model.norm.weight",
        "model.layers.1.input_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "model.layers.2.self_attn.qkv.temp": "model.layers.1.self_attn.qk_norm.temp",
        "model.layers.2.self_attn.qkv.val_proj2.weight": "model.layers.1.self_attn.qkv_proj.v_proj_delayed.weight",
        "model.layers.2.self_attn.qkv.conv_qk.1.bias": "model.layers.1.self_attn.qkv_proj.conv_qk_grouped.bias",
        "model.layers.3.zaya_block.router.rmsnorm_eda.weight": "model.layers.1.mlp.gate.router_mlp.norm.weight",
        "model.layers.3.zaya_block.router.router_mlp.4.weight": "model.layers.1.mlp.gate.router_mlp.out_proj.weight",
    }
    for legacy_name, upstream_name in same.items():
        assert torch.equal(legacy[legacy_name], upstream[upstream_name]), legacy_name
    for e in range(4):
        fc1 = legacy[f"model.layers.3.zaya_block.experts.local_experts.{e}.linear_fc1.weight"]
        fc2 = legacy[f"model.layers.3.zaya_block.experts.local_experts.{e}.linear_fc2.weight"]
        assert torch.equal(fc1, upstream["model.layers.1.mlp.experts.gate_up_proj"][e])  # [2I, H], gate rows first
        assert torch.equal(fc2, upstream["model.layers.1.mlp.experts.down_proj"][e])  # [H, I]


def test_zaya1_base_sized_names_and_shapes_on_meta():
    with torch.device("meta"):
        model = ZayaForCausalLM(ZayaConfig(**legacy_config_to_upstream(zaya1_base_legacy_config())))
    upstream = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    legacy = upstream_state_dict_to_legacy(upstream, 40)
    shapes = {name: tuple(tensor.shape) for name, tensor in legacy.items()}

    assert shapes["model.embed_tokens.weight"] == (262272, 2048)
    assert shapes["model.layers.0.self_attn.qkv.linear_q.weight"] == (1024, 2048)
    assert shapes["model.layers.0.self_attn.qkv.linear_k.weight"] == (256, 2048)
    assert shapes["model.layers.0.self_attn.qkv.val_proj1.weight"] == (128, 2048)
    assert shapes["model.layers.0.self_attn.qkv.conv_qk.0.weight"] == (1280, 1, 2)
    assert shapes["model.layers.0.self_attn.qkv.conv_qk.1.weight"] == (1280, 128, 2)
    assert shapes["model.layers.0.self_attn.qkv.temp"] == (2,)
    assert shapes["model.layers.78.self_attn.o_proj.weight"] == (2048, 1024)
    assert shapes["model.layers.79.zaya_block.router.down_proj.weight"] == (256, 2048)
    assert shapes["model.layers.79.zaya_block.router.router_mlp.4.weight"] == (17, 256)
    assert shapes["model.layers.79.zaya_block.router.balancing_biases"] == (17,)
    assert shapes["model.layers.79.zaya_block.experts.local_experts.15.linear_fc1.weight"] == (4096, 2048)
    assert shapes["model.layers.79.zaya_block.experts.local_experts.15.linear_fc2.weight"] == (2048, 2048)
    residual_scalings = {name.rsplit(".", 1)[0] for name in legacy if ".res_scale." in name}
    assert len(residual_scalings) == 81
    assert not any(name.startswith("model.layers.80.") for name in legacy)


def test_missing_and_unexpected_tensors_are_named():
    upstream = random_model().state_dict()
    del upstream["lm_head.weight"]
    legacy = upstream_state_dict_to_legacy(upstream, 3)

    broken = dict(legacy)
    del broken["model.layers.2.self_attn.qkv.temp"]
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.2\.self_attn\.qkv\.temp"):
        legacy_state_dict_to_upstream(broken, 3)

    broken = dict(legacy)
    del broken["model.layers.5.zaya_block.experts.local_experts.2.linear_fc2.weight"]
    with pytest.raises(ValueError, match=r"missing .*local_experts\.2\.linear_fc2"):
        legacy_state_dict_to_upstream(broken, 3)

    broken = legacy | {"model.layers.1.zaya_block.experts.local_experts.4.linear_fc1.weight": torch.zeros(64, 64)}
    with pytest.raises(ValueError, match=r"missing .*local_experts\.4\.linear_fc2"):
        legacy_state_dict_to_upstream(broken, 3)

    broken = legacy | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"unexpected 1 tensor\(s\): model\.layers\.0\.self_attn\.rotary_emb"):
        legacy_state_dict_to_upstream(broken, 3)

    with pytest.raises(ValueError, match=r"unexpected 38 tensor\(s\): model\.layers\.4\."):
        legacy_state_dict_to_upstream(legacy, 2)  # the wrong block count leaves a block over

    broken = dict(upstream)
    del broken["model.layers.1.post_mlp_residual_scale.residual_bias"]
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.post_mlp_residual_scale"):
        upstream_state_dict_to_legacy(broken, 3)

    broken = upstream | {"model.layers.0.mlp.gate.router_states_scale": torch.ones(16)}
    with pytest.raises(ValueError, match=r"unexpected 1 tensor\(s\): model\.layers\.0\.mlp\.gate\.router_states"):
        upstream_state_dict_to_legacy(broken, 3)


# --- files -----------------------------------------------------------------------------------------------------------


def logits_of(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits


@pytest.mark.parametrize("max_shard_bytes", [2**30, 40_000], ids=["one-file", "sharded"])
@pytest.mark.parametrize("skip_expert_mode", ["zero", "scaled_input"])
def test_legacy_checkpoint_on_disk_gives_the_same_logits(tmp_path, max_shard_bytes, skip_expert_mode):
    source = random_model(skip_expert_mode=skip_expert_mode)
    out_dir = tmp_path / "legacy"
    save_legacy_checkpoint(source.config.to_dict(), source.state_dict(), out_dir, max_shard_bytes=max_shard_bytes)

    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == ["legacy"]  # no staging directory left behind
    written = json.loads((out_dir / "config.json").read_text())
    assert written["zaya_layers"] == ["a", 4] * 3
    sharded = (out_dir / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_bytes < 2**30)
    assert (out_dir / "model.safetensors").exists() != sharded

    config, state_dict = load_legacy_checkpoint(out_dir)
    assert config["skip_expert_mode"] == skip_expert_mode
    assert "lm_head.weight" not in state_dict  # tied: not stored
    loaded = ZayaForCausalLM.from_pretrained(None, config=ZayaConfig(**config), state_dict=state_dict).eval()

    input_ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits_of(loaded, input_ids), logits_of(source, input_ids))


def test_zyphra_legacy_checkpoint_loads_with_scaled_input_skip(tmp_path):
    """A checkpoint as Zyphra wrote it (no extra fields) means ZAYA1-base's behaviour."""
    source = random_model(skip_expert_mode="scaled_input", router_rms_norm_eps=1e-6, residual_in_fp32=False)
    save_legacy_checkpoint(source.config.to_dict(), source.state_dict(), tmp_path / "ckpt")
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert "skip_expert_mode" not in written and "layernorm_epsilon" not in written
    assert written["residual_in_fp32"] is False

    config, _ = load_legacy_checkpoint(tmp_path / "ckpt")
    assert (config["skip_expert_mode"], config["router_rms_norm_eps"], config["residual_in_fp32"]) == (
        "scaled_input",
        1e-6,
        False,
    )


def test_stock_transformers_model_survives_the_legacy_layout(tmp_path):
    """The conversion does not depend on our model: upstream transformers' own `zaya` round-trips too."""
    source = random_model(transformers.ZayaForCausalLM, transformers.ZayaConfig)
    save_legacy_checkpoint(source.config.to_dict(), source.state_dict(), tmp_path / "ckpt")
    config, state_dict = load_legacy_checkpoint(tmp_path / "ckpt")
    assert config["skip_expert_mode"] == "zero"  # stock transformers' behaviour is kept
    loaded = transformers.ZayaForCausalLM.from_pretrained(
        None, config=transformers.ZayaConfig(**config), state_dict=state_dict
    ).eval()
    input_ids = torch.randint(0, TINY["vocab_size"], (1, 10), generator=torch.Generator().manual_seed(2))
    assert torch.equal(logits_of(loaded, input_ids), logits_of(source, input_ids))


def test_save_is_atomic_and_refuses_to_clobber(tmp_path):
    source = random_model(num_hidden_layers=2)
    out_dir = tmp_path / "ckpt"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("old")
    with pytest.raises(FileExistsError):
        save_legacy_checkpoint(source.config.to_dict(), source.state_dict(), out_dir)
    assert (out_dir / "keep.txt").read_text() == "old"

    broken = {k: v for k, v in source.state_dict().items() if "post_mlp_residual_scale" not in k}
    with pytest.raises(ValueError, match="missing"):
        save_legacy_checkpoint(source.config.to_dict(), broken, out_dir, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (out_dir / "keep.txt").exists()

    save_legacy_checkpoint(source.config.to_dict(), source.state_dict(), out_dir, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert not (out_dir / "keep.txt").exists()
    assert_bit_exact(
        load_legacy_checkpoint(out_dir)[1], {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    )


def test_loading_rejects_an_upstream_checkpoint(tmp_path):
    random_model(num_hidden_layers=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="zaya_layers"):
        load_legacy_checkpoint(tmp_path)


def test_loading_rejects_an_index_that_disagrees_with_its_shards(tmp_path):
    source = random_model(num_hidden_layers=2)
    save_legacy_checkpoint(source.config.to_dict(), source.state_dict(), tmp_path / "ckpt", max_shard_bytes=40_000)
    index_path = tmp_path / "ckpt" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.self_attn.qkv.extra"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"disagree on tensors: model\.layers\.0\.self_attn\.qkv\.extra"):
        load_legacy_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_conversion_command_writes_the_upstream_layout(tmp_path, capsys, dtype):
    """`python -m zaya_model.legacy_layout` on Zyphra's layout: ZAYA1-base behaviour, the same logits and tensors
    (dtype included), the other files along; stock transformers reads the result. `from_pretrained` on the legacy
    directory names the command."""
    source = random_model(skip_expert_mode="scaled_input", router_rms_norm_eps=1e-6, residual_in_fp32=False).to(dtype)
    for layer in source.model.layers:  # the model keeps its balancing biases in fp32 whatever its dtype
        layer.mlp.gate.balancing_biases = layer.mlp.gate.balancing_biases.float()
    save_legacy_checkpoint(source.config.to_dict(), source.state_dict(), tmp_path / "legacy", max_shard_bytes=40_000)
    (tmp_path / "legacy" / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    for load in (ZayaForCausalLM.from_pretrained, ZayaConfig.from_pretrained):
        with pytest.raises(ValueError, match="python -m zaya_model.legacy_layout"):
            load(tmp_path / "legacy")

    assert legacy_layout.main([str(tmp_path / "legacy"), str(tmp_path / "converted")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "converted")
    converted = tmp_path / "converted"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["converted", "legacy"]  # no staging left behind
    assert (converted / "tokenizer_config.json").read_text() == '{"model_max_length": 256}'
    written = json.loads((converted / "config.json").read_text())
    assert "zaya_layers" not in written and written["model_type"] == "zaya"
    assert written["architectures"] == ["ZayaForCausalLM"]
    loaded = ZayaForCausalLM.from_pretrained(converted, dtype=dtype).eval()
    assert loaded.config.skip_expert_mode == "scaled_input" and loaded.config.router_rms_norm_eps == 1e-6
    expected = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    assert_bit_exact(load_legacy_checkpoint(tmp_path / "legacy")[1], expected)
    assert_bit_exact({k: v for k, v in loaded.state_dict().items() if k != "lm_head.weight"}, expected)
    if dtype == torch.float32:  # `.to(bfloat16)` cast the source's RoPE frequencies, which a loaded model keeps fp32
        input_ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
        assert torch.equal(logits_of(loaded, input_ids), logits_of(source, input_ids))

    stock = transformers.ZayaForCausalLM.from_pretrained(converted, dtype=dtype)
    assert_bit_exact(
        {k: v for k, v in stock.state_dict().items() if "balancing_biases" not in k},
        {k: v for k, v in loaded.state_dict().items() if "balancing_biases" not in k},
    )


def test_the_conversion_command_refuses_what_it_cannot_write(tmp_path, capsys):
    source = random_model(num_hidden_layers=2)
    save_legacy_checkpoint(source.config.to_dict(), source.state_dict(), tmp_path / "legacy")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("old")
    assert legacy_layout.main([str(tmp_path / "legacy"), str(tmp_path / "out")]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["keep.txt"]
    assert legacy_layout.main([str(tmp_path / "legacy"), str(tmp_path / "legacy"), "--overwrite"]) == 1
    assert "directory of its own" in capsys.readouterr().err
    source.save_pretrained(tmp_path / "upstream")  # already converted: not a legacy checkpoint
    assert legacy_layout.main([str(tmp_path / "upstream"), str(tmp_path / "again")]) == 1
    assert "zaya_layers" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()

    command = [sys.executable, "-m", "zaya_model.legacy_layout", str(tmp_path / "legacy"), str(tmp_path / "out")]
    done = subprocess.run([*command, "--overwrite"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "out" / "keep.txt").exists()
    assert ZayaForCausalLM.from_pretrained(tmp_path / "out").config.num_hidden_layers == 2
