"""Alembic is the only source of the schema: the migrations must build exactly what the models describe."""

from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from server.db.base import Base
from server.db.migrations import alembic_config, head_revision, schema_is_current, upgrade
from server.db.session import make_engine


def test_migrations_match_the_models(tmp_path, fresh_database):
    with fresh_database(tmp_path) as url:
        upgrade(url)
        engine = make_engine(url)
        try:
            with engine.connect() as connection:
                context = MigrationContext.configure(connection, opts={"compare_type": True})
                assert compare_metadata(context, Base.metadata) == []
            assert set(Base.metadata.tables) <= set(inspect(engine).get_table_names())
        finally:
            engine.dispose()


def test_downgrade_removes_everything_and_upgrade_rebuilds_it(tmp_path, fresh_database):
    with fresh_database(tmp_path) as url:
        engine = make_engine(url)
        try:
            assert not schema_is_current(engine)
            upgrade(url)
            assert schema_is_current(engine)
            upgrade_tables = set(inspect(engine).get_table_names())
            assert {
                "api_keys",
                "files",
                "fine_tuning_jobs",
                "job_events",
                "checkpoints",
                "model_versions",
                "model_aliases",
                "alias_history",
                "alias_approvals",
                "audit_log",
                "inference_records",
            } <= upgrade_tables

            command.downgrade(alembic_config(url), "base")
            assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
            upgrade(url)
            assert set(inspect(engine).get_table_names()) == upgrade_tables
        finally:
            engine.dispose()


def test_there_is_a_single_head():
    assert head_revision() is not None


def test_alias_moves_made_before_move_numbers_are_numbered_in_order(tmp_path, fresh_database):
    with fresh_database(tmp_path) as url:
        command.upgrade(alembic_config(url), "0005")
        engine = make_engine(url)
        try:
            moves = [("zaya", "production"), ("zaya", "staging"), ("zaya", "production"), ("zaya", "production")]
            with engine.begin() as connection:
                for name, alias in moves:
                    connection.execute(
                        text(
                            "INSERT INTO alias_history (model_name, alias, action, created_at)"
                            " VALUES (:name, :alias, 'promote', CURRENT_TIMESTAMP)"
                        ),
                        {"name": name, "alias": alias},
                    )
            upgrade(url)
            with engine.connect() as connection:
                numbered = connection.execute(text("SELECT alias, sequence FROM alias_history ORDER BY id")).all()
            assert [tuple(row) for row in numbered] == [
                ("production", 1),
                ("staging", 1),
                ("production", 2),
                ("production", 3),
            ]
        finally:
            engine.dispose()


ROWS_AT_0008 = [
    "INSERT INTO api_keys (id, name, role, prefix, secret_hash, created_at)"
    " VALUES ('key_a', 'ops', 'admin', 'zk-aaaaaaaaaaaa', :hash, CURRENT_TIMESTAMP)",
    "INSERT INTO api_keys (id, name, role, prefix, secret_hash, created_at, created_by)"
    " VALUES ('key_d', 'team', 'data', 'zk-dddddddddddd', :hash, CURRENT_TIMESTAMP, 'key_a')",
    "INSERT INTO files (id, filename, purpose, bytes, sha256, status, created_at, created_by)"
    " VALUES ('file-1', 'train.jsonl', 'fine-tune', 10, :hash, 'processed', CURRENT_TIMESTAMP, 'key_d')",
    "INSERT INTO model_versions (id, name, version, kind, path, status, created_at)"
    " VALUES ('mv-base', 'zaya', 1, 'full', '/models/zaya', 'active', CURRENT_TIMESTAMP)",
    "INSERT INTO fine_tuning_jobs (id, model, training_file_id, status, method, created_at, created_by, attempts,"
    " base_version_id, fine_tuned_model, result_model_version_id)"
    " VALUES ('ftjob-1', 'zaya', 'file-1', 'succeeded', '{}', CURRENT_TIMESTAMP, 'key_d', 1, 'mv-base',"
    " 'ft:zaya:zaya::ftjob-1', 'mv-tuned')",
    "INSERT INTO model_versions (id, name, version, kind, path, status, created_at, job_id, base_version_id)"
    " VALUES ('mv-tuned', 'ft:zaya:zaya::ftjob-1', 1, 'adapter', '/jobs/ftjob-1', 'active', CURRENT_TIMESTAMP,"
    " 'ftjob-1', 'mv-base')",
    "INSERT INTO job_events (job_id, created_at, level, type, message) VALUES ('ftjob-1', CURRENT_TIMESTAMP, 'info',"
    " 'message', 'done')",
    "INSERT INTO checkpoints (id, job_id, step, path, created_at) VALUES ('ftckpt-1', 'ftjob-1', 4, '/c', "
    " CURRENT_TIMESTAMP)",
    "INSERT INTO inference_records (created_at, api_key_id, endpoint, requested_model, prompt_tokens,"
    " completion_tokens, status_code)"
    " VALUES (CURRENT_TIMESTAMP, 'key_d', 'completions', 'zaya', 3, 4, 200)",
    "INSERT INTO audit_log (created_at, actor_key_id, action, method, path, status_code, outcome)"
    " VALUES (CURRENT_TIMESTAMP, 'key_d', 'files.create', 'POST', '/v1/files', 200, 'success')",
    "INSERT INTO audit_log (created_at, action, method, path, status_code, outcome)"
    " VALUES (CURRENT_TIMESTAMP, 'files.create', 'POST', '/v1/files', 401, 'denied')",
]


def test_projects_put_existing_rows_in_the_default_project(tmp_path, fresh_database):
    """An install at 0008 with keys, files, a finished job and its model version: after the upgrade everything is in
    the `default` project, the job's model version is limited to it, base models to no one, and references hold."""
    with fresh_database(tmp_path) as url:
        command.upgrade(alembic_config(url), "0008")
        engine = make_engine(url)
        try:
            with engine.begin() as connection:
                for statement in ROWS_AT_0008:
                    connection.execute(text(statement), {"hash": "0" * 64})
            upgrade(url)
            with engine.connect() as connection:
                projects = connection.execute(text("SELECT id, name FROM projects")).all()
                assert [tuple(row) for row in projects] == [("proj_default", "default")]
                for table in ("api_keys", "files", "fine_tuning_jobs", "inference_records"):
                    owners = connection.execute(text(f"SELECT DISTINCT project_id FROM {table}")).scalars().all()
                    assert owners == ["proj_default"], table
                audit = connection.execute(text("SELECT actor_key_id, project_id FROM audit_log ORDER BY id")).all()
                assert [tuple(row) for row in audit] == [("key_d", "proj_default"), (None, None)]
                access = connection.execute(text("SELECT version_id, project_id FROM model_version_projects")).all()
                assert [tuple(row) for row in access] == [("mv-tuned", "proj_default")]
                kept = connection.execute(text("SELECT created_by FROM api_keys WHERE id = 'key_d'")).scalar()
                assert kept == "key_a"
            # The new references are enforced: a file of a project that does not exist is refused.
            with pytest.raises(IntegrityError), engine.begin() as connection:
                connection.execute(
                    text(
                        "INSERT INTO files (id, filename, purpose, bytes, sha256, status, created_at, project_id)"
                        " VALUES ('file-2', 'x', 'fine-tune', 1, :hash, 'processed', CURRENT_TIMESTAMP, 'proj_none')"
                    ),
                    {"hash": "0" * 64},
                )
            command.downgrade(alembic_config(url), "0008")
            with engine.connect() as connection:
                assert connection.execute(text("SELECT count(*) FROM files")).scalar() == 1
                assert "projects" not in inspect(engine).get_table_names()
        finally:
            engine.dispose()
