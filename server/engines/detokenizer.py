"""Incremental detokenisation with stop strings that are never split across stream chunks.

Each token extends the decoded text and only text that is final is released: an incomplete UTF-8 sequence waits
for its next byte, and a tail that could be the start of a stop string waits until it either completes the stop
string (the choice ends there, the stop string itself is never shown) or stops matching.

The text grows by `tokenizers`' `DecodeStream`, which decodes a few tokens around the new one: a token costs the
same at the end of a long answer as at its start (decoding all tokens again each time costs more with every token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from zaya_model.pretrain.tokenizer import decode_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class StopStringDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.token_ids: list[int] = []
        self.released = 0  # characters of the decoded text already handed out
        self.pending = ""  # decoded text after those, not yet final
        self.stopped = False
        self._stream = DecodeStream(skip_special_tokens=True)

    def add(self, token_id: int, *, may_stop: bool = True) -> str:
        """Append a token; return the text that became final (empty while held back). Sets `stopped` on a stop.

        With `may_stop` false (before a choice's `min_tokens`) no stop string ends the choice and nothing is held
        back: stop strings are looked for in the text that follows."""
        self.token_ids.append(token_id)
        # None while the token ends inside a UTF-8 sequence (its text comes with a later token).
        self.pending += self._stream.step(self.tokenizer.backend_tokenizer, token_id) or ""
        if not may_stop:
            return self._release(len(self.pending))
        # Every stop match starts in the unreleased tail: a tail that could begin a stop string is always held.
        cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self.pending) - self._held_back(self.pending))

    def flush(self) -> str:
        """The held-back text, at the end of a choice that did not end on a stop string."""
        if self.stopped:
            return ""
        # Decoded in full, once: that includes an incomplete UTF-8 sequence at the end (as U+FFFD).
        self.pending = decode_text(self.tokenizer, self.token_ids, skip_special_tokens=True)[self.released :]
        return self._release(len(self.pending))

    def _held_back(self, pending: str) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _release(self, length: int) -> str:
        """Hand out the first `length` characters of the pending text."""
        text, self.pending = self.pending[:length], self.pending[length:]
        self.released += len(text)
        return text
