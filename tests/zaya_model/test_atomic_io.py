"""Atomic files and directories: the destination holds the old content or the new, and no temporary stays behind."""

from __future__ import annotations

import json

import pytest

from zaya_model.training.atomic_io import (
    atomic_directory,
    atomic_file,
    write_json_atomic,
    write_lines_atomic,
    write_text_atomic,
)


def test_files_are_replaced_whole(tmp_path):
    path = tmp_path / "state.json"
    write_json_atomic(path, {"step": 1})
    write_json_atomic(path, {"step": 2})
    assert json.loads(path.read_text()) == {"step": 2}
    write_text_atomic(tmp_path / "note.txt", "hello")
    write_lines_atomic(tmp_path / "lines.jsonl", (f"{n}\n" for n in range(3)))
    assert (tmp_path / "lines.jsonl").read_text() == "0\n1\n2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lines.jsonl", "note.txt", "state.json"]


def test_a_failed_file_write_keeps_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("old\n")

    def lines():
        yield "new\n"
        raise RuntimeError("the source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        write_lines_atomic(path, lines())
    with pytest.raises(TypeError):
        write_json_atomic(path, {"not json": object()})
    with pytest.raises(ValueError), atomic_file(path) as temporary:
        temporary.write_text("half")
        raise ValueError("stop")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["data.jsonl"]


def test_directories_are_published_whole(tmp_path):
    destination = tmp_path / "model"
    with atomic_directory(destination) as staging:
        (staging / "config.json").write_text("{}")
        assert not destination.exists()
    with pytest.raises(OSError), atomic_directory(destination) as staging:
        (staging / "config.json").write_text('{"new": true}')
        raise OSError("disk full")
    assert (destination / "config.json").read_text() == "{}"
    with atomic_directory(destination) as staging:
        (staging / "weights").write_text("w")
    assert sorted(p.name for p in destination.iterdir()) == ["weights"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
