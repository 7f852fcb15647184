"""Per-key rate limits: requests and tokens per window (a minute by default), refused with 429 and `Retry-After`.

Counting is the `limits` library's fixed-window strategy, whose counters are O(1) per key whatever a request costs
(a moving window keeps one entry per token). The counters live in `Settings.rate_limit_storage_uri`: "memory://"
(the default) keeps them in this process, so with several API processes each enforces the limits on its own share;
a shared store (e.g. "redis://...") makes them hold across processes.

Requests refused by these limits are not counted: a key that is over its limit cannot extend its own wait by
retrying. A request refused for a prompt longer than the model's context is charged its prompt's tokens all the same
(`charge_refused`), so prompts that cannot fit cost a key its budget as running them would.

Failed authentications (no key, or an unknown or revoked one, at the API or the console's sign-in form) are counted
per client address (`rate_limit_auth_failures_per_minute`): past the limit, that address gets 429 instead of 401
until its window ends, and the sign-in form tries no key from it.
"""

from __future__ import annotations

import math
import time

from limits import RateLimitItem, RateLimitItemPerSecond
from limits.storage import storage_from_string
from limits.strategies import FixedWindowRateLimiter

from server.errors import RateLimited
from server.settings import Settings


class RateLimits:
    def __init__(self, settings: Settings) -> None:
        self._limiter = FixedWindowRateLimiter(storage_from_string(settings.rate_limit_storage_uri))
        window = settings.rate_limit_window_s
        self._window = window
        self._requests = _item(settings.rate_limit_requests_per_minute, window)
        self._tokens = _item(settings.rate_limit_tokens_per_minute, window)
        self._auth_failures = _item(settings.rate_limit_auth_failures_per_minute, window)

    def check_request(self, key_id: str) -> None:
        """Count one request of `key_id`, or raise `RateLimited` if its window is used up."""
        if self._requests is not None:
            self._charge(self._requests, key_id, 1, "requests", param=None)

    def charge_tokens(self, key_id: str, tokens: int, *, param: str) -> None:
        """Count an inference request's tokens (prompt + max completion), or raise `RateLimited`."""
        if self._tokens is None:
            return
        if tokens > self._tokens.amount:
            # It would never fit: waiting does not help, so no Retry-After (clients would retry in vain).
            raise RateLimited(
                f"This request needs {tokens} tokens (prompt plus {param}), more than this key's limit of "
                f"{self._tokens.amount} tokens per {self._window_text()}. Lower {param} or shorten the prompt.",
                retry_after_s=None,
                param=param,
            )
        self._charge(self._tokens, key_id, tokens, "tokens", param=param)

    def charge_refused(self, key_id: str, tokens: int) -> None:
        """Count the tokens of a request refused for its prompt's length, at most the whole limit; never raises (the
        request is refused already, and the next one finds the window used up)."""
        if self._tokens is not None and tokens > 0:
            self._limiter.hit(self._tokens, key_id, cost=min(tokens, self._tokens.amount))

    def check_auth_failures_left(self, address: str) -> None:
        """Raise `RateLimited` if `address` has used up its failed authentications for this window (counts nothing)."""
        if self._auth_failures is None or self._limiter.test(self._auth_failures, "auth-failure", address):
            return
        reset_at, _remaining = self._limiter.get_window_stats(self._auth_failures, "auth-failure", address)
        retry_after = max(1, math.ceil(reset_at - time.time()))
        raise RateLimited(
            f"Too many requests without a valid API key from this address: at most {self._auth_failures.amount} "
            f"per {self._window_text()}. Retry after {retry_after} s.",
            retry_after_s=retry_after,
        )

    def count_auth_failure(self, address: str) -> None:
        """Count one failed authentication from `address`."""
        if self._auth_failures is not None:
            self._limiter.hit(self._auth_failures, "auth-failure", address)

    def _charge(self, item: RateLimitItem, key_id: str, cost: int, what: str, *, param: str | None) -> None:
        if self._limiter.test(item, key_id, cost=cost):
            self._limiter.hit(item, key_id, cost=cost)
            return
        reset_at, remaining = self._limiter.get_window_stats(item, key_id)
        retry_after = max(1, math.ceil(reset_at - time.time()))
        raise RateLimited(
            f"Rate limit reached for {what}: this key may use {item.amount} {what} per {self._window_text()} "
            f"({remaining} left in this window). Retry after {retry_after} s.",
            retry_after_s=retry_after,
            param=param,
        )

    def _window_text(self) -> str:
        return "minute" if self._window == 60 else f"{self._window} s"


def _item(amount: int, window_s: int) -> RateLimitItem | None:
    return RateLimitItemPerSecond(amount, window_s) if amount > 0 else None
