"""Console sessions, kept in an encrypted cookie: the API key, a CSRF token, the session's id and its start.

The cookie carries the key's secret so every console request is authenticated by the API's own key lookup (which
also sees revocation at once). It is encrypted and authenticated (Fernet), so the browser holds an opaque token, and
its timestamp is the last user action: a cookie older than the idle timeout is refused and re-issued otherwise. A
session also ends at its absolute lifetime after sign-in, however active, and at sign-out: its id is then recorded
in the database (`server.services.console_sessions`) and every copy of its cookie is refused.
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
    id: str
    started: int  # Unix seconds of the sign-in

    @classmethod
    def start(cls, secret: str, *, now: float | None = None) -> ConsoleSession:
        started = int(time.time() if now is None else now)
        return cls(secret=secret, csrf=new_token(), id=new_token(), started=started)


def new_token() -> str:
    return secrets.token_urlsafe(32)


class SessionCodec:
    def __init__(self, key: str, idle_timeout_s: float, max_age_s: float | None = None) -> None:
        # Any string works as the configured secret: Fernet gets its 32 bytes from its hash.
        self._fernet = Fernet(base64.urlsafe_b64encode(hashlib.sha256(key.encode()).digest()))
        self._ttl = max(1, math.ceil(idle_timeout_s))
        self._max_age = max(1, math.ceil(max_age_s)) if max_age_s is not None else None

    @property
    def idle_timeout_s(self) -> int:
        return self._ttl

    def expires_at(self, session: ConsoleSession) -> float | None:
        """Unix seconds when the session ends whatever its activity (its absolute lifetime); None: never."""
        return session.started + self._max_age if self._max_age is not None else None

    def cookie_max_age(self, session: ConsoleSession, *, now: float | None = None) -> int:
        """Seconds the browser should keep the cookie: the idle timeout, or what is left of the session's lifetime."""
        expires = self.expires_at(session)
        if expires is None:
            return self._ttl
        return max(0, min(self._ttl, math.floor(expires - (time.time() if now is None else now))))

    def encode(self, session: ConsoleSession, *, now: float | None = None) -> str:
        payload = json.dumps(
            {"secret": session.secret, "csrf": session.csrf, "id": session.id, "started": session.started}
        ).encode()
        return self._fernet.encrypt_at_time(payload, int(time.time() if now is None else now)).decode()

    def decode(self, token: str, *, now: float | None = None) -> ConsoleSession | None:
        """The session, or None when the cookie is forged, tampered with, malformed, idle for too long or older
        than the absolute lifetime."""
        moment = time.time() if now is None else now
        try:
            payload = self._fernet.decrypt_at_time(token.encode(), self._ttl, int(moment))
            data = json.loads(payload)
            session = ConsoleSession(
                secret=str(data["secret"]), csrf=str(data["csrf"]), id=str(data["id"]), started=int(data["started"])
            )
        except (InvalidToken, ValueError, KeyError, TypeError):
            return None
        expires = self.expires_at(session)
        return session if expires is None or moment < expires else None
