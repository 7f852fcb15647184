"""`zaya data validate | preview | pii`: exit codes and output, in process and once through the console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from finetune_helpers import chat

from zaya_cli.main import main


def test_validate_exit_codes_and_problem_lines(tokenizer_dir, write_jsonl, capsys):
    good = write_jsonl([chat(answer="a"), chat(answer="b")], "good.jsonl")
    assert main(["data", "validate", str(good), "--tokenizer", str(tokenizer_dir), "--max-seq-len", "256"]) == 0
    summary = capsys.readouterr().out
    assert "good.jsonl: valid; 2 well-formed examples in 2 lines; format chat;" in summary

    bad = write_jsonl([chat(), "{oops", {"messages": [{"role": "bot", "content": "x"}]}], "bad.jsonl")
    assert main(["data", "validate", str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{bad}: line 2: invalid JSON: Expecting property name enclosed in double quotes (column 2)"
    assert out[1].startswith(f"{bad}: line 3: messages[0].role: unknown role 'bot'")
    assert out[2] == f"{bad}: line 3: messages: the conversation has no assistant message"
    assert out[3].startswith(f"{bad}: 3 problems;")


def test_validate_json_with_validation_file(write_jsonl, capsys):
    train = write_jsonl([chat(answer="a"), chat(answer="b")], "train.jsonl")
    valid = write_jsonl([chat(answer="b")], "valid.jsonl")
    assert main(["data", "validate", str(train), "--validation", str(valid), "--json", "--max-problems", "1"]) == 1
    reports = json.loads(capsys.readouterr().out)
    assert reports["training"]["problems"][0]["code"] == "overlap"
    assert reports["training"]["problems"][0]["line"] == 2
    assert reports["validation"]["is_valid"] is True


def test_validate_errors_are_one_line(write_jsonl, tmp_path, capsys):
    data = write_jsonl([chat()])
    assert main(["data", "validate", str(tmp_path / "missing.jsonl")]) == 1
    assert capsys.readouterr().err.strip() == f"zaya data: error: file not found: {tmp_path / 'missing.jsonl'}"
    assert main(["data", "validate", str(data), "--max-seq-len", "10"]) == 1
    assert "--max-seq-len needs --tokenizer" in capsys.readouterr().err
    assert main(["data", "validate", str(data), "--tokenizer", str(tmp_path / "nope")]) == 1
    assert "tokenizer directory not found" in capsys.readouterr().err


def test_preview_marks_trained_text(tokenizer_dir, write_jsonl, capsys):
    data = write_jsonl([chat(answer="Disposition: CLOSE")])
    assert main(["data", "preview", str(data), "--tokenizer", str(tokenizer_dir), "--line", "1"]) == 0
    assert "⟦Disposition: CLOSE<|im_end|>⟧" in capsys.readouterr().out
    assert main(["data", "preview", str(data), "--tokenizer", str(tokenizer_dir), "--line", "2"]) == 1
    assert "fewer than 2 lines" in capsys.readouterr().err


def test_pii_report_and_redaction(write_jsonl, tmp_path, capsys):
    data = write_jsonl([chat(user="IBAN DE89 3704 0044 0532 0130 00"), chat()])
    out = tmp_path / "clean.jsonl"
    assert main(["data", "pii", str(data), "--redact", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "IBAN: 1 (lines 1)" in printed and "PERSON: not scanned" in printed
    assert "[IBAN]" in out.read_text()


def test_console_script_exit_codes(write_jsonl):
    zaya = Path(sys.executable).parent / "zaya"
    assert zaya.exists(), "install the project (pip install -e .) to get the zaya console script"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    good = write_jsonl([chat()], "good.jsonl")
    bad = write_jsonl([chat(), "{oops"], "bad.jsonl")
    ok = subprocess.run([zaya, "data", "validate", good], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    failed = subprocess.run([zaya, "data", "validate", bad], capture_output=True, text=True, env=env, timeout=120)
    assert failed.returncode == 1
    assert failed.stdout.splitlines()[0].startswith(f"{bad}: line 2: invalid JSON")
