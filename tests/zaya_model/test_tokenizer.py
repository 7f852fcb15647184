"""The shared tokenizer trainer: byte-level BPE, special tokens, ChatML template with generation markers."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from zaya_model.pretrain import (
    END_OF_TURN_TOKEN,
    SPECIAL_TOKENS,
    end_of_turn_token_id,
    generation_eos_token_ids,
    train_tokenizer,
)

CORPUS = [
    f"Case {i}: customer wired ${i * 37:,} to account {1000 + i * 11} after an alert for structuring. "
    f"Investigator note: {'escalate' if i % 3 else 'close'} — reviewed café receipts ünd 日本 wires."
    for i in range(300)
]
CONVERSATION = [
    {"role": "system", "content": "You are a bank investigator."},
    {"role": "user", "content": "Summarise case 7."},
    {"role": "assistant", "content": "Draft answer", "weight": 0},
    {"role": "user", "content": "Now the disposition?"},
    {"role": "assistant", "content": "Escalate: rapid movement of funds."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(iter(CORPUS), vocab_size=420)


def test_trains_fast_on_a_small_corpus():
    start = time.perf_counter()
    tokenizer = train_tokenizer(CORPUS, vocab_size=400)
    assert time.perf_counter() - start < 2.0
    assert 300 < len(tokenizer) <= 400


def test_round_trips_any_text_including_unseen_bytes(tokenizer):
    for text in [CORPUS[5], "  leading spaces\ttabs\nnewlines", "emoji 🙂 and ß, never seen: ℵ∂"]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert tokenizer.bos_token_id not in ids  # plain encoding adds no special tokens


def test_numbers_are_split_into_digits(tokenizer):
    tokens = tokenizer.tokenize("wired 9,459.14 on 2025")
    assert [token for token in tokens if any(c.isdigit() for c in token)] == list("9459142025")
    merged = train_tokenizer(iter(CORPUS), vocab_size=420, split_digits=False)
    assert any(len(token.strip("Ġ")) > 1 and token.strip("Ġ").isdigit() for token in merged.get_vocab())
    assert not any(len(token.strip("Ġ")) > 1 and token.strip("Ġ").isdigit() for token in tokenizer.get_vocab())


def test_special_tokens_are_single_tokens(tokenizer):
    for token in SPECIAL_TOKENS:
        ids = tokenizer.encode(f"a{token}b")
        assert tokenizer.convert_tokens_to_ids(token) in ids
        assert len(tokenizer.encode(token)) == 1
    assert tokenizer.decode(tokenizer.encode("x<|im_end|>"), skip_special_tokens=True) == "x"
    assert {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token} == set(SPECIAL_TOKENS[:3])
    assert generation_eos_token_ids(tokenizer) == [end_of_turn_token_id(tokenizer), tokenizer.eos_token_id]


def test_assistant_mask_marks_weighted_assistant_turns_with_end_of_turn(tokenizer):
    rendered = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = rendered["input_ids"], rendered["assistant_masks"]
    trained = [token for token, keep in zip(ids, mask, strict=True) if keep]
    assert tokenizer.decode(trained) == "Escalate: rapid movement of funds." + END_OF_TURN_TOKEN
    assert trained[-1] == end_of_turn_token_id(tokenizer)
    # The trained tokens are one contiguous span: the weight-0 draft answer is context only.
    first = mask.index(1)
    assert all(mask[first : first + len(trained)])
    assert tokenizer.decode(ids).startswith(tokenizer.bos_token + "<|im_start|>system\n")


def test_generation_prompt_opens_an_assistant_turn(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert text.endswith("Summarise case 7.<|im_end|>\n<|im_start|>assistant\n")
    without = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False)
    assert without.endswith("<|im_end|>\n")


def test_save_and_load_offline(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode(CORPUS[3]) == tokenizer.encode(CORPUS[3])
    assert loaded.chat_template == tokenizer.chat_template
    assert end_of_turn_token_id(loaded) == end_of_turn_token_id(tokenizer)
    assert loaded.apply_chat_template(CONVERSATION, tokenize=False) == tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False
    )


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="vocab_size must be at least"):
        train_tokenizer(CORPUS, vocab_size=100)
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer([], vocab_size=400)
