"""The shared tokenizer trainer: byte-level BPE, special tokens, ChatML template with generation markers."""

from __future__ import annotations

import json
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


def test_numbers_are_split_into_digits_when_asked(tokenizer):
    split = train_tokenizer(iter(CORPUS), vocab_size=420, split_digits=True)
    tokens = split.tokenize("wired 9,459.14 on 2025")
    assert [token for token in tokens if any(c.isdigit() for c in token)] == list("9459142025")
    assert any(len(token.strip("Ġ")) > 1 and token.strip("Ġ").isdigit() for token in tokenizer.get_vocab())
    assert not any(len(token.strip("Ġ")) > 1 and token.strip("Ġ").isdigit() for token in split.get_vocab())


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


LOOKUP_CASE = {
    "type": "function",
    "function": {
        "name": "lookup_case",
        "description": "Fetch a case file.",
        "parameters": {"type": "object", "properties": {"case_id": {"type": "string"}}, "required": ["case_id"]},
    },
}
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a bank investigator."},
    {"role": "user", "content": "Compare cases 1 and 2."},
    {
        "role": "assistant",
        "content": "Fetching both.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup_case", "arguments": {"case_id": "1"}}},
            # OpenAI's messages carry the arguments as JSON text: rendered as given.
            {"id": "call_2", "type": "function", "function": {"name": "lookup_case", "arguments": '{"case_id": "2"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Case 1: closed."},
    {"role": "tool", "tool_call_id": "call_2", "content": "Case 2: open."},
    {"role": "assistant", "content": "Case 2 is still open."},
]


def test_a_conversation_without_tools_renders_as_plain_chatml(tokenizer):
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == (
        "<|startoftext|><|im_start|>system\nYou are a bank investigator.<|im_end|>\n"
        "<|im_start|>user\nSummarise case 7.<|im_end|>\n"
        "<|im_start|>assistant\nDraft answer<|im_end|>\n"
        "<|im_start|>user\nNow the disposition?<|im_end|>\n"
        "<|im_start|>assistant\nEscalate: rapid movement of funds.<|im_end|>\n"
    )


def test_tools_join_the_system_turn_and_calls_and_results_have_their_own_tags(tokenizer):
    text = tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=[LOOKUP_CASE], tokenize=False)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|startoftext|><|im_start|>system\nYou are a bank investigator.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(LOOKUP_CASE, ensure_ascii=False)}\n</tools>" in system
    assert "You are a bank investigator." not in rest  # the system message is not repeated
    assert (
        "<|im_start|>assistant\nFetching both.\n"
        '<tool_call>\n{"name": "lookup_case", "arguments": {"case_id": "1"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup_case", "arguments": {"case_id": "2"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\nCase 1: closed.\n</tool_response><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\nCase 2: open.\n</tool_response><|im_end|>\n"
    ) in rest

    alone = tokenizer.apply_chat_template(TOOL_CONVERSATION[1:2], tools=[LOOKUP_CASE], tokenize=False)
    assert alone.startswith("<|startoftext|><|im_start|>system\n# Tools\n")


def test_a_call_without_text_starts_the_turn_with_its_tag(tokenizer):
    call = {"role": "assistant", "content": None, "tool_calls": TOOL_CONVERSATION[2]["tool_calls"][:1]}
    text = tokenizer.apply_chat_template([TOOL_CONVERSATION[1], call], tools=[LOOKUP_CASE], tokenize=False)
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "lookup_case", "arguments": {"case_id": "1"}}\n'
        "</tool_call><|im_end|>\n"
    )


def test_the_assistant_mask_covers_tool_calls_and_not_tool_results(tokenizer):
    rendered = tokenizer.apply_chat_template(
        TOOL_CONVERSATION, tools=[LOOKUP_CASE], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    trained = [token for token, keep in zip(rendered["input_ids"], rendered["assistant_masks"], strict=True) if keep]
    assert tokenizer.decode(trained) == (
        "Fetching both.\n"
        '<tool_call>\n{"name": "lookup_case", "arguments": {"case_id": "1"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup_case", "arguments": {"case_id": "2"}}\n</tool_call><|im_end|>'
        "Case 2 is still open.<|im_end|>"
    )
