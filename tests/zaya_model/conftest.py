"""Fixtures of the pretraining tests: a synthetic case corpus and a tokenizer trained on it (once per module)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pretrain_helpers import save_corpus_tokenizer, write_case_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_case_corpus(tmp_path_factory.mktemp("corpus") / "cases.jsonl")


@pytest.fixture(scope="module")
def tokenizer_dir(corpus, tmp_path_factory) -> Path:
    return save_corpus_tokenizer(corpus, tmp_path_factory.mktemp("tokenizer"))
