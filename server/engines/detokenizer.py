"""Incremental detokenisation with stop strings that are never split across stream chunks.

Each step decodes the choice's tokens and releases only text that is final: an incomplete UTF-8 sequence (decoded
as U+FFFD) waits for its next byte, and a tail that could be the start of a stop string waits until it either
completes the stop string (the choice ends there, the stop string itself is never shown) or stops matching.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


REPLACEMENT_CHARACTER = "\ufffd"


class StopStringDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.token_ids: list[int] = []
        self.released = 0  # characters of the decoded text already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append a token; return the text that became final (empty while held back). Sets `stopped` on a stop."""
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith(REPLACEMENT_CHARACTER):
            return ""
        pending = text[self.released :]
        # Every stop match starts in the unreleased tail: a tail that could begin a stop string is always held.
        cut = min((i for i in (pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(pending[:cut])
        return self._release(pending[: len(pending) - self._held_back(pending)])

    def flush(self) -> str:
        """The held-back text, at the end of a choice that did not end on a stop string."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return self._release(text[self.released :])

    def _held_back(self, pending: str) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _release(self, text: str) -> str:
        self.released += len(text)
        return text
