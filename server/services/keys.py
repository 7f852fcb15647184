"""API keys: random secrets shown once, stored as a sha256 hash beside a unique lookup prefix."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from server.db.base import utcnow
from server.db.models import DEFAULT_PROJECT_ID, ApiKey, Role
from server.services.access import Scope, get_or_404

SECRET_MARKER = "zk-"
PREFIX_LENGTH = len(SECRET_MARKER) + 12


@dataclass(frozen=True)
class CreatedKey:
    key: ApiKey
    secret: str


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_key(
    session: Session,
    *,
    name: str,
    role: Role | str,
    created_by: str | None = None,
    project_id: str = DEFAULT_PROJECT_ID,
) -> CreatedKey:
    """Create a key in a project and return its secret: the only time the secret exists outside the client."""
    role = Role(role)
    name = name.strip()
    if not name:
        raise ValueError("name must not be empty")
    secret = SECRET_MARKER + secrets.token_urlsafe(32)
    key = ApiKey(
        name=name,
        role=role.value,
        prefix=secret[:PREFIX_LENGTH],
        secret_hash=hash_secret(secret),
        created_by=created_by,
        project_id=project_id,
    )
    session.add(key)
    session.flush()
    return CreatedKey(key=key, secret=secret)


def find_active(session: Session, secret: str) -> ApiKey | None:
    """The active key whose secret this is, or None (a read). Revocation is read from the database on every call."""
    if not secret.startswith(SECRET_MARKER) or len(secret) <= PREFIX_LENGTH:
        return None
    key = session.scalars(select(ApiKey).where(ApiKey.prefix == secret[:PREFIX_LENGTH])).one_or_none()
    if key is None or not hmac.compare_digest(key.secret_hash, hash_secret(secret)) or key.revoked_at is not None:
        return None
    return key


def last_use_to_record(key: ApiKey, *, resolution: timedelta) -> dict[str, Any] | None:
    """`MARK_USED`'s parameters when `key.last_used_at` is older than `resolution` (else None: no write per use)."""
    now = utcnow()
    if key.last_used_at is None or now - key.last_used_at >= resolution:
        return {"key_id": key.id, "used_at": now}
    return None


_keys = ApiKey.metadata.tables[ApiKey.__tablename__]
MARK_USED = update(_keys).where(_keys.c.id == bindparam("key_id")).values(last_used_at=bindparam("used_at"))


def authenticate(session: Session, secret: str, *, last_used_resolution: timedelta) -> ApiKey | None:
    """`find_active`, recording the key's use in `session` (committed)."""
    key = find_active(session, secret)
    if key is not None and (last_use := last_use_to_record(key, resolution=last_used_resolution)) is not None:
        key.last_used_at = last_use["used_at"]
        session.commit()
    return key


def list_keys(session: Session, scope: Scope) -> list[ApiKey]:
    return list(session.scalars(scope.owned(select(ApiKey), ApiKey.project_id).order_by(ApiKey.created_at, ApiKey.id)))


def get_key(session: Session, key_id: str) -> ApiKey:
    """The key with this id (any project's: keys are the admins'); 404 naming `key_id` if none."""
    return get_or_404(session, ApiKey, key_id, what="API key", param="key_id")


def revoke_key(session: Session, key: ApiKey) -> ApiKey:
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        session.flush()
    return key
