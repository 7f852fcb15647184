"""LoRA through PEFT: attention projections (target_modules) and fused 3-D experts (target_parameters)."""

import peft
import torch
from tiny_models import TINY_ZAYA, randomize_zaya

from zaya_model import ZayaConfig, ZayaForCausalLM

ATTENTION = ["q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def base_model():
    torch.manual_seed(0)
    return randomize_zaya(ZayaForCausalLM(ZayaConfig(**TINY_ZAYA)))


def test_lora_on_attention_and_experts_trains_saves_and_reloads(tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, target_parameters=EXPERTS)
    model = peft.get_peft_model(base_model(), config)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert sum("mlp.experts" in n for n in trainable) >= 2 * 2 * TINY_ZAYA["num_hidden_layers"]
    assert any("qkv_proj.q_proj.lora_A" in n for n in trainable)
    assert all("lora_" in n for n in trainable)

    input_ids = torch.arange(3, 35).repeat(2)[None].repeat(2, 1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    frozen_before = model.get_base_model().model.embed_tokens.weight.clone()
    losses = []
    for _ in range(15):
        loss = model(input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert torch.equal(model.get_base_model().model.embed_tokens.weight, frozen_before)

    model.eval()
    with torch.no_grad():
        expected = model(input_ids).logits
    model.save_pretrained(tmp_path)
    saved = set(peft.utils.load_peft_weights(str(tmp_path)))
    assert any("experts" in name for name in saved) and any("q_proj" in name for name in saved)

    reloaded = peft.PeftModel.from_pretrained(base_model(), tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, expected)
        # The adapter really changes the model: the bare base gives other logits.
        assert (base_model().eval()(input_ids).logits - expected).abs().max() > 1e-4
