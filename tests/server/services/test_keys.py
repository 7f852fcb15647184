"""API key secrets: random, shown once, stored only as a hash, revocable, with a last-used time."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from sqlalchemy import text

from server.db.models import ApiKey, Role
from server.services.keys import authenticate, create_key, revoke_key

NO_THROTTLE = timedelta(0)


def test_secrets_are_stored_only_as_hashes(sessions):
    with sessions() as session:
        created = create_key(session, name="ops", role=Role.admin)
        session.commit()
        rows = session.execute(text("SELECT * FROM api_keys")).all()
    stored = " ".join(str(value) for row in rows for value in row)
    assert created.secret not in stored
    assert created.secret[len(created.key.prefix) :] not in stored
    assert hashlib.sha256(created.secret.encode()).hexdigest() in stored


def test_each_secret_is_unique_and_long(sessions):
    with sessions() as session:
        secrets = {create_key(session, name=f"k{i}", role="analyst").secret for i in range(20)}
    assert len(secrets) == 20
    assert all(len(secret) >= 40 for secret in secrets)


def test_authenticate_accepts_only_the_exact_active_secret(sessions):
    with sessions() as session:
        created = create_key(session, name="svc", role="data")
        session.commit()
        secret = created.secret
        assert authenticate(session, secret, last_used_resolution=NO_THROTTLE).id == created.key.id
        wrong_tail = secret[:-1] + ("A" if secret[-1] != "A" else "B")
        for attempt in (wrong_tail, secret[:20], "", "Bearer " + secret, secret + "x"):
            assert authenticate(session, attempt, last_used_resolution=NO_THROTTLE) is None

        revoke_key(session, session.get(ApiKey, created.key.id))
        session.commit()
        assert authenticate(session, secret, last_used_resolution=NO_THROTTLE) is None


def test_last_used_time_is_recorded(sessions):
    with sessions() as session:
        created = create_key(session, name="svc", role="analyst")
        session.commit()
        assert created.key.last_used_at is None
        first = authenticate(session, created.secret, last_used_resolution=NO_THROTTLE).last_used_at
        assert first is not None
        # Within the resolution window the time is not rewritten (no write per request).
        assert authenticate(session, created.secret, last_used_resolution=timedelta(hours=1)).last_used_at == first


@pytest.mark.parametrize("role", ["root", "", "ADMIN"])
def test_unknown_roles_are_refused(sessions, role):
    with sessions() as session, pytest.raises(ValueError):
        create_key(session, name="x", role=role)
