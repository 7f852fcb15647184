"""Fault-injection fixtures: a real stack (`zaya serve` / `zaya worker` processes) on a fresh data dir and database
per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.load_test.stack import MODEL_NAME, Stack, build_model

from .processes import assert_no_secret_logged


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model `zaya run` bootstraps, after one training step (tokenizer trained here), built once for the
    session."""
    return build_model(tmp_path_factory.mktemp("model") / MODEL_NAME)


@pytest.fixture
def stack(tmp_path, model_dir, fresh_database) -> Iterator[Stack]:
    """A migrated stack with the model registered and a key per role; processes are started by the test."""
    with (
        fresh_database(tmp_path) as database_url,
        Stack(tmp_path / "data", database_url=database_url, log_dir=tmp_path) as prepared,
    ):
        prepared.prepare(model_dir)
        yield prepared
    assert_no_secret_logged(prepared)
