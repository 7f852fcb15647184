"""Alembic is the only source of the schema: the migrations must build exactly what the models describe."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

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
