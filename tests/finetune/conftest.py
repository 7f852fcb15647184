"""Fixtures for dataset tests: a tokenizer trained here on synthetic case files, and a JSONL writer."""

from __future__ import annotations

import json

import pytest

from finetune.datasets.synthetic import generate_cases, render_case_file
from zaya_model.pretrain import train_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    texts = [render_case_file(case) for case in generate_cases(60, seed=11)]
    tokenizer = train_tokenizer(texts, vocab_size=600)
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def write_jsonl(tmp_path):
    """write_jsonl(lines, name) -> path; dicts/lists are JSON-encoded, str and bytes are written as they are."""

    def write(lines, name="data.jsonl"):
        path = tmp_path / name
        with open(path, "wb") as file:
            for line in lines:
                if isinstance(line, bytes):
                    file.write(line + b"\n")
                elif isinstance(line, str):
                    file.write(line.encode("utf-8") + b"\n")
                else:
                    file.write(json.dumps(line).encode("utf-8") + b"\n")
        return path

    return write
