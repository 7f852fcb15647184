"""One choice's output as its engine produces tokens, turned into `ChoiceDelta`s the same way by every engine.

Each token is counted and detokenised; the choice ends at an end-of-sequence token (unless `ignore_eos`; never
shown), a stop string (not before `min_tokens`) or `max_tokens`. Text held back by the detokenizer (a possible start
of a stop string, an incomplete UTF-8 sequence) keeps its tokens' logprobs with it until it is released.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.engines.base import ChoiceDelta, SamplingParams, TokenLogprob
from server.engines.detokenizer import StopStringDetokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ChoiceOutput:
    def __init__(
        self,
        index: int,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        end_ids: frozenset[int],
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        self.index, self.params, self.end_ids = index, params, end_ids
        self.detokenizer = StopStringDetokenizer(tokenizer, params.stop)
        self.generated = 0
        self.finish_reason: str | None = None
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self.prompt_logprobs = prompt_logprobs  # sent with the first delta, then cleared

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Count `token` (with its logprob entry, if asked for) and release its text; whether the choice ended."""
        params = self.params
        self.generated += 1
        if token in self.end_ids and not params.ignore_eos:
            self.end("stop")
            return True
        if logprob is not None:
            self._logprobs.append(logprob)
        self._text.append(self.detokenizer.add(token, may_stop=self.generated > params.min_tokens))
        if self.detokenizer.stopped:
            self.finish_reason = "stop"
        elif self.generated >= params.max_tokens:
            self.end("length")
        return self.finished

    def end(self, reason: str) -> None:
        """End the choice here, releasing the text held back."""
        self._text.append(self.detokenizer.flush())
        self.finish_reason = reason

    def take(self, cached_prompt_tokens: int = 0) -> ChoiceDelta | None:
        """What became final since the last delta, or None while there is nothing to send."""
        text = "".join(self._text)
        if not (text or self.finished):
            return None
        delta = ChoiceDelta(
            index=self.index,
            text=text,
            logprobs=self._logprobs,
            finish_reason=self.finish_reason,
            completion_tokens=self.generated,
            cached_prompt_tokens=cached_prompt_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )
        self._text, self._logprobs, self.prompt_logprobs = [], [], None
        return delta
