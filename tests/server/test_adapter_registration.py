"""Adapter versions are checked at registration, and merged there where per-request LoRA cannot apply them
(`server.services.adapters`).

Through `POST /v1/admin/models`: an attention adapter registers as is; an adapter that trains experts or token
embedding rows registers with a merged checkpoint beside it that equals HF + PEFT; adapters that cannot be served are
a 400 naming `path`.
"""

from __future__ import annotations

import json

import peft
import pytest
import torch

from zaya_model import ZayaConfig, ZayaForCausalLM
from zaya_model.vllm_plugin.adapters import merged_checkpoint

ATTENTION = ["q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture
def admin(auth):
    return auth("admin")


def register(client, admin, path, name, **extra):
    return client.post("/v1/admin/models", headers=admin, json={"name": name, "path": str(path), **extra})


def save_adapter(
    base: ZayaForCausalLM, path, *, experts: bool, seed: int = 0, token_rows: list[int] | None = None
) -> peft.PeftModel:
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=2,
        target_modules=ATTENTION,
        target_parameters=EXPERTS if experts else None,
        trainable_token_indices={"embed_tokens": token_rows} if token_rows else None,
        init_lora_weights=False,
    )
    model = peft.get_peft_model(base, config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "trainable_tokens_delta" in name:
                parameter.normal_()
    model.save_pretrained(path)
    return model


def test_adapters_are_checked_and_expert_adapters_merged_at_registration(client, admin, tiny_model_dir, tmp_path):
    assert register(client, admin, tiny_model_dir, "base").status_code == 200
    attention = tmp_path / "attention"
    save_adapter(ZayaForCausalLM.from_pretrained(tiny_model_dir), attention, experts=False)
    registered = register(client, admin, attention, "attention", base_model="base")
    assert registered.status_code == 200, registered.text
    assert not merged_checkpoint(attention).exists()  # served per request

    experts = tmp_path / "experts"
    reference = save_adapter(ZayaForCausalLM.from_pretrained(tiny_model_dir), experts, experts=True, seed=1)
    registered = register(client, admin, experts, "experts", base_model="base")
    assert registered.status_code == 200, registered.text
    merged = ZayaForCausalLM.from_pretrained(merged_checkpoint(experts)).eval()
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, reference(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    assert (merged_checkpoint(experts) / "tokenizer_config.json").is_file()

    # Token rows (fine-tuning trains the chat template's): vLLM's LoRA has none per request, so merged too.
    rows = tmp_path / "rows"
    reference = save_adapter(ZayaForCausalLM.from_pretrained(tiny_model_dir), rows, experts=False, token_rows=[2, 9])
    registered = register(client, admin, rows, "rows", base_model="base")
    assert registered.status_code == 200, registered.text
    merged = ZayaForCausalLM.from_pretrained(merged_checkpoint(rows)).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, reference(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_adapters_that_cannot_be_served_are_refused_naming_path(client, admin, tiny_model_dir, tmp_path):
    assert register(client, admin, tiny_model_dir, "base").status_code == 200

    def refused(path) -> str:
        response = register(client, admin, path, "bad", base_model="base")
        assert response.status_code == 400 and response.json()["error"]["param"] == "path", response.text
        return response.json()["error"]["message"]

    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    assert "not a PEFT adapter" in refused(no_weights)

    other_config = ZayaConfig.from_pretrained(tiny_model_dir).to_dict()
    other_config.update(hidden_size=48)
    for experts in (False, True):
        path = tmp_path / f"other-base-{experts}"
        save_adapter(ZayaForCausalLM(ZayaConfig.from_dict(other_config)), path, experts=experts)
        assert "another base model" in refused(path)
    assert not merged_checkpoint(tmp_path / "other-base-True").exists()

    router = tmp_path / "router"
    model = peft.get_peft_model(
        ZayaForCausalLM.from_pretrained(tiny_model_dir), peft.LoraConfig(r=2, target_modules=["fc1"])
    )
    model.save_pretrained(router)
    assert "'fc1'" in refused(router)
