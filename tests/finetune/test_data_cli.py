"""`zaya data validate | preview | pii`: exit codes and output, in process and once through the console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
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
    good = write_jsonl([chat()], "good.jsonl")
    bad = write_jsonl([chat(), "{oops"], "bad.jsonl")
    ok = subprocess.run([zaya, "data", "validate", good], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    failed = subprocess.run([zaya, "data", "validate", bad], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    assert failed.stdout.splitlines()[0].startswith(f"{bad}: line 2: invalid JSON")


def test_sample_writes_chats_the_api_accepts_and_a_corpus(tokenizer_dir, tmp_path, capsys):
    import shutil

    from finetune.datasets.synthetic import parse_disposition
    from finetune.settings import FineTuneSettings
    from server.services.training import dataset_problems
    from zaya_model import ZayaConfig

    out = tmp_path / "sample"
    assert main(["data", "sample", "--cases", "12", "--output", str(out), "--corpus", "5"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote 12 chats to {out / 'train.jsonl'}" in printed and "wrote 3 chats to" in printed
    train, valid = out / "train.jsonl", out / "validation.jsonl"
    records = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(records) == 12 and len(valid.read_text().splitlines()) == 3
    labels = [parse_disposition(record["messages"][-1]["content"]) for record in records]
    assert sorted(set(labels)) == ["CLOSE", "ESCALATE", "SAR"] and labels.count("SAR") == 4  # balanced
    corpus = [json.loads(line)["text"] for line in (out / "corpus.jsonl").read_text().splitlines()]
    assert len(corpus) == 5 and all(text.startswith("Case CASE-") for text in corpus)
    assert all("\nClosing note:\nDisposition: " in text for text in corpus)  # an archive of closed cases
    other = tmp_path / "bare"
    assert main(["data", "sample", "--cases", "3", "--output", str(other), "--corpus", "5", "--bare-corpus"]) == 0
    bare = [json.loads(line)["text"] for line in (other / "corpus.jsonl").read_text().splitlines()]
    assert [text + "\n" for text in bare] == [text[: text.index("Closing note:")] for text in corpus]
    capsys.readouterr()

    model_dir = tmp_path / "model"  # what the API checks a job's files against: the base model's tokenizer and context
    shutil.copytree(tokenizer_dir, model_dir)
    ZayaConfig(max_position_embeddings=2048).save_pretrained(model_dir)
    assert dataset_problems(train, model_dir=model_dir, settings=FineTuneSettings(), other_path=valid) == []
    assert dataset_problems(valid, model_dir=model_dir, settings=FineTuneSettings(), other_path=None) == []

    before = train.read_bytes()  # the same seed writes the same bytes
    assert main(["data", "sample", "--cases", "12", "--output", str(out)]) == 0
    assert train.read_bytes() == before
    with pytest.raises(SystemExit) as exit_:
        main(["data", "sample", "--cases", "0", "--output", str(out)])
    assert exit_.value.code == 2
    assert "--cases: must be a positive integer, got 0" in capsys.readouterr().err


def test_sample_variant_words_chats_and_corpus_alike(tmp_path, capsys):
    out = tmp_path / "ledger"
    assert main(["data", "sample", "--cases", "3", "--output", str(out), "--corpus", "4", "--variant", "ledger"]) == 0
    corpus = [json.loads(line)["text"] for line in (out / "corpus.jsonl").read_text().splitlines()]
    chats = [json.loads(line)["messages"] for line in (out / "train.jsonl").read_text().splitlines()]
    assert all(text.startswith("Investigation file CASE-") for text in corpus)
    assert all("\n\nInvestigation file CASE-" in chat[1]["content"] for chat in chats)
    assert main(["data", "sample", "--cases", "3", "--output", str(tmp_path / "seeded"), "--variant", "17"]) == 0
    capsys.readouterr()
    for flag in ("--variant", "--validation-variant"):
        with pytest.raises(SystemExit) as exit_:
            main(["data", "sample", "--cases", "3", "--output", str(out), flag, "prose"])
        assert exit_.value.code == 2
        assert f"{flag}: unknown variant 'prose'" in capsys.readouterr().err


def test_sample_refuses_a_file_as_output(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["data", "sample", "--cases", "3", "--output", str(target)]) == 1
    assert "--output" in capsys.readouterr().err
