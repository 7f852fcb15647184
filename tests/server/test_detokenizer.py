"""`StopStringDetokenizer`: streamed text equals a full decode, stop strings are cut, no re-decoding per token."""

from __future__ import annotations

import random

import pytest

from finetune.datasets.synthetic import generate_chat_examples
from server.engines.detokenizer import StopStringDetokenizer
from zaya_model.pretrain import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["\n".join(message["content"] for message in example["messages"]) for example in generate_chat_examples(20)]
    # A byte-level BPE: many tokens are single bytes, so random ids split UTF-8 characters across tokens.
    return train_tokenizer(texts + ["Überweisung an Zoë: 5.000 € → 日本"], vocab_size=400, model_max_length=8192)


def stream(tokenizer, token_ids, stop=()) -> tuple[list[str], StopStringDetokenizer]:
    detokenizer = StopStringDetokenizer(tokenizer, stop)
    deltas = []
    for token in token_ids:
        deltas.append(detokenizer.add(token))
        if detokenizer.stopped:
            return deltas, detokenizer
    deltas.append(detokenizer.flush())
    return deltas, detokenizer


def test_streamed_text_equals_a_full_decode_of_text_and_of_random_bytes(tokenizer):
    text = "Konto DE89 3704 0044 0532 0130 00 — Überweisung an Zoë: 5.000 € → 日本"
    text_ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    random_ids = [rng.randrange(len(tokenizer)) for _ in range(3000)]
    cut_character = text_ids[:-1]  # ends inside "本": the flush releases its bytes as U+FFFD, as a full decode does
    assert tokenizer.decode(cut_character).endswith("\ufffd")
    for ids in (text_ids, random_ids, cut_character):
        deltas, _ = stream(tokenizer, ids)
        # Also mid-stream no delta ends inside a character (that would add a U+FFFD the full decode has not).
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_not_shown(tokenizer):
    ids = [tokenizer.bos_token_id, *tokenizer.encode("Case closed.", add_special_tokens=False), tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, ids)[0]) == "Case closed."


def test_a_token_is_decoded_without_decoding_the_whole_answer_again(tokenizer, monkeypatch):
    calls = []
    decode = type(tokenizer).decode
    monkeypatch.setattr(type(tokenizer), "decode", lambda self, *a, **k: calls.append(1) or decode(self, *a, **k))
    ids = tokenizer.encode("Disposition: file a SAR. " * 40, add_special_tokens=False)
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == "Disposition: file a SAR. " * 40
    assert len(calls) == 1  # the flush at the end


def test_stop_strings_are_cut_and_never_split_across_deltas(tokenizer):
    text = "The customer wired funds to an account abroad. Disposition: escalate."
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, detokenizer = stream(tokenizer, ids, stop=("Disposition",))
    assert detokenizer.stopped and "".join(deltas) == text[: text.index("Disposition")]
    assert not any("Dispo" in delta for delta in deltas)
    # A tail that starts a stop string and then stops matching is released: nothing is lost.
    deltas, detokenizer = stream(tokenizer, ids, stop=("Disposition: close",))
    assert not detokenizer.stopped and "".join(deltas) == text
