"""API key secrets: compared in constant time, stored only as hashes, never logged, revoked at once.

Runs the real server process (`zaya serve`) and reads what it leaves behind: every row of every table, the raw
database files, and the server's log.
"""

from __future__ import annotations

import ast
import hashlib
import inspect

import httpx
import pytest
from sqlalchemy import select

from benchmarks.load_test.stack import MODEL_NAME, Stack, build_model
from server.db.base import Base
from server.db.models import ApiKey
from server.services import keys
from server.services.keys import PREFIX_LENGTH


def _compares(node: ast.AST) -> list[ast.Compare]:
    return [child for child in ast.walk(node) if isinstance(child, ast.Compare)]


def test_key_secrets_are_checked_by_prefix_lookup_and_a_constant_time_hash_comparison():
    """Reads `keys.find_active` itself (the lookup of the API and of the console's sign-in): the row is found by its
    public prefix, and the secret's hash is compared with `hmac.compare_digest`, never with `==` (whose time depends
    on how many leading characters match)."""
    tree = ast.parse(inspect.getsource(keys.find_active))
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert "hmac.compare_digest" in calls
    for compare in _compares(tree):
        text = ast.unparse(compare)
        assert "secret_hash" not in text and "hash_secret" not in text, f"non-constant-time comparison: {text}"
    assert "ApiKey.prefix ==" in ast.unparse(tree)  # an indexed lookup by the non-secret prefix


@pytest.mark.slow
def test_secrets_are_stored_only_as_hashes_never_logged_and_revocation_is_immediate(tmp_path, fresh_database):
    model_dir = build_model(tmp_path / "model" / MODEL_NAME)
    with fresh_database(tmp_path) as database_url, Stack(tmp_path / "data", database_url=database_url) as stack:
        stack.prepare(model_dir)
        stack.start_server()
        client = httpx.Client(base_url=stack.url, timeout=60)
        admin = stack.headers("admin")

        created = client.post("/v1/admin/keys", headers=admin, json={"name": "analyst two", "role": "analyst"})
        assert created.status_code == 200, created.text
        secret = created.json()["secret"]
        mine = {"Authorization": f"Bearer {secret}"}
        assert client.get("/v1/models", headers=mine).status_code == 200
        # Near misses and error paths, each of which could echo the key into a log line.
        forged = secret[:PREFIX_LENGTH] + "x" * (len(secret) - PREFIX_LENGTH)
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {forged}"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": secret}).status_code == 401  # no "Bearer"
        malformed = client.post("/v1/chat/completions", headers=mine, content=b"{not json")
        assert malformed.status_code == 400
        unknown = {"model": "no-such-model", "messages": [{"role": "user", "content": secret}]}
        assert client.post("/v1/chat/completions", headers=mine, json=unknown).status_code == 404

        revoked = client.post(f"/v1/admin/keys/{created.json()['id']}/revoke", headers=admin)
        assert revoked.status_code == 200
        assert client.get("/v1/models", headers=mine).status_code == 401  # the very next request

        secrets = [secret, *stack.keys.values()]
        with stack.database() as sessions, sessions() as session:
            stored = session.scalar(select(ApiKey).where(ApiKey.id == created.json()["id"]))
            assert stored.secret_hash == hashlib.sha256(secret.encode()).hexdigest()
            dump = "\n".join(
                repr(tuple(row)) for table in Base.metadata.sorted_tables for row in session.execute(table.select())
            )
        # On SQLite also the raw files (free pages and the write-ahead log included); a PostgreSQL server's files
        # are not this test's to read.
        database_bytes = b"".join(path.read_bytes() for path in tmp_path.glob("scratch-*.db*"))
        assert database_bytes or not database_url.startswith("sqlite")
    log = stack.server_log.read_text(errors="replace")
    assert "GET /v1/models" in log  # the log is there and has the requests in it
    for value in secrets:
        private = value[PREFIX_LENGTH:]  # the part of the secret that is not the public lookup prefix
        assert private not in dump, "a secret is stored in the database"
        assert private.encode() not in database_bytes, "a secret is in the database files"
        assert private not in log, "a secret was logged"
