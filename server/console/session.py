"""Console sessions, kept entirely in an encrypted cookie (no table): the API key and a CSRF token.

The cookie carries the key's secret so every console request is authenticated by the API's own key lookup (which
also sees revocation at once). It is encrypted and authenticated (Fernet), so the browser holds an opaque token, and
its timestamp is the last user action: a cookie older than the idle timeout is refused and re-issued otherwise.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import secrets
import time
from dataclasses import dataclass

from cryptography.fernet import Fernet, InvalidToken

COOKIE_NAME = "zaya_console"
# Before sign-in: the CSRF token of the sign-in form (double submit), on a short-lived cookie of its own.
LOGIN_COOKIE_NAME = "zaya_console_login"
LOGIN_COOKIE_MAX_AGE_S = 3600


@dataclass(frozen=True)
class ConsoleSession:
    secret: str
    csrf: str

    @classmethod
    def start(cls, secret: str) -> ConsoleSession:
        return cls(secret=secret, csrf=new_token())


def new_token() -> str:
    return secrets.token_urlsafe(32)


class SessionCodec:
    def __init__(self, key: str, idle_timeout_s: float) -> None:
        # Any string works as the configured secret: Fernet gets its 32 bytes from its hash.
        self._fernet = Fernet(base64.urlsafe_b64encode(hashlib.sha256(key.encode()).digest()))
        self._ttl = max(1, math.ceil(idle_timeout_s))

    @property
    def idle_timeout_s(self) -> int:
        return self._ttl

    def encode(self, session: ConsoleSession, *, now: float | None = None) -> str:
        payload = json.dumps({"secret": session.secret, "csrf": session.csrf}).encode()
        return self._fernet.encrypt_at_time(payload, int(time.time() if now is None else now)).decode()

    def decode(self, token: str, *, now: float | None = None) -> ConsoleSession | None:
        """The session, or None when the cookie is forged, tampered with, malformed or idle for too long."""
        try:
            payload = self._fernet.decrypt_at_time(token.encode(), self._ttl, int(time.time() if now is None else now))
            data = json.loads(payload)
            return ConsoleSession(secret=str(data["secret"]), csrf=str(data["csrf"]))
        except (InvalidToken, ValueError, KeyError, TypeError):
            return None
