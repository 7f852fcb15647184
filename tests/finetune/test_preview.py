"""Preview: the rendered example and exactly which tokens are trained."""

from __future__ import annotations

import pytest

from finetune.datasets import preview_line
from zaya_model.pretrain import END_OF_TURN_TOKEN

CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You are an investigator."},
        {"role": "user", "content": "Summarise case 7."},
        {"role": "assistant", "content": "A draft.", "weight": 0},
        {"role": "user", "content": "And the disposition?"},
        {"role": "assistant", "content": "Disposition: SAR", "weight": 1},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Structuring."},
    ]
}


def test_trained_tokens_are_weighted_assistant_turns_with_end_of_turn(tokenizer, write_jsonl):
    path = write_jsonl(["{bad", CONVERSATION])
    preview = preview_line(path, 2, tokenizer)

    trained = [segment.text for segment in preview.segments if segment.trained]
    assert trained == ["Disposition: SAR" + END_OF_TURN_TOKEN, "Structuring." + END_OF_TURN_TOKEN]
    assert "".join(segment.text for segment in preview.segments) == tokenizer.apply_chat_template(
        CONVERSATION["messages"], tokenize=False
    )
    assert preview.n_trained_tokens == sum(segment.n_tokens for segment in preview.segments if segment.trained)
    assert preview.n_tokens == len(preview.tokens) == sum(segment.n_tokens for segment in preview.segments)
    assert [token.text for token in preview.tokens if token.trained][-1] == END_OF_TURN_TOKEN


def test_text_and_dict_views(tokenizer, write_jsonl):
    preview = preview_line(write_jsonl([CONVERSATION]), 1, tokenizer)
    text = preview.to_text()
    assert "⟦Disposition: SAR<|im_end|>⟧" in text
    assert "A draft.<|im_end|>" in text and "⟦A draft." not in text
    counts = f"tokens: {preview.n_tokens} | trained: {preview.n_trained_tokens}"
    header = f"format: chat | {counts} (trained text is inside ⟦ ⟧)"
    assert text.splitlines()[0] == header
    data = preview.to_dict()
    assert data["n_trained_tokens"] == preview.n_trained_tokens
    assert data["tokens"][0] == {"id": tokenizer.bos_token_id, "text": tokenizer.bos_token, "trained": False}


def test_prompt_completion_preview(tokenizer, write_jsonl):
    preview = preview_line(write_jsonl([{"prompt": "Case 4:", "completion": " close it"}]), 1, tokenizer)
    assert [(segment.text, segment.trained) for segment in preview.segments] == [
        ("Case 4:", False),
        (" close it" + tokenizer.eos_token, True),
    ]


def test_bad_lines_give_clear_errors(tokenizer, write_jsonl):
    path = write_jsonl(["{bad", {"messages": []}])
    with pytest.raises(ValueError, match="line 1: invalid JSON"):
        preview_line(path, 1, tokenizer)
    with pytest.raises(ValueError, match="line 2: messages: the conversation has no messages"):
        preview_line(path, 2, tokenizer)
    with pytest.raises(ValueError, match="fewer than 3 lines"):
        preview_line(path, 3, tokenizer)
