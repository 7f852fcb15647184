"""The tiny model `zaya run` bootstraps when no model is registered: a tokenizer and a 2-layer ZAYA trained for a
few steps on synthetic bank chats. The demo and the tests start from it too.
"""

from __future__ import annotations

import random
from pathlib import Path

BOOTSTRAP_CONTEXT = 2048


def build_tiny_model(output_dir: Path, *, train_steps: int = 100, seed: int = 0) -> Path:
    """Train a tokenizer and a tiny ZAYA model on synthetic bank chats; write both to `output_dir` atomically."""
    import torch

    from finetune.artifacts import atomic_directory
    from finetune.datasets.synthetic import generate_chat_examples
    from zaya_model import ZayaConfig, ZayaForCausalLM
    from zaya_model.pretrain import generation_eos_token_ids, train_tokenizer

    random.seed(seed)
    torch.manual_seed(seed)
    conversations = [example["messages"] for example in generate_chat_examples(90, seed=seed)]
    plain_text = ("\n".join(message["content"] for message in conversation) for conversation in conversations)
    tokenizer = train_tokenizer(plain_text, vocab_size=640, model_max_length=BOOTSTRAP_CONTEXT)
    config = ZayaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=64,
        num_experts=4,
        router_hidden_size=32,
        max_position_embeddings=BOOTSTRAP_CONTEXT,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=generation_eos_token_ids(tokenizer),
    )
    model = ZayaForCausalLM(config)
    if train_steps:
        _train(model, tokenizer, conversations, train_steps)
    model.eval()

    with atomic_directory(output_dir) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return output_dir


def _train(model, tokenizer, conversations: list[list[dict]], steps: int, batch: int = 4, length: int = 96) -> None:
    """A few hundred AdamW steps on random windows of the rendered chats: enough for bank-flavoured output."""
    import torch

    rendered = "".join(tokenizer.apply_chat_template(conversation, tokenize=False) for conversation in conversations)
    ids = torch.tensor(tokenizer.encode(rendered, add_special_tokens=False, verbose=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - length - 1, (batch,))
        windows = torch.stack([ids[start : start + length] for start in starts])
        loss = model(input_ids=windows, labels=windows).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
