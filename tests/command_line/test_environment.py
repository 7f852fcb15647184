"""Every option of a `zaya` command can be set in the environment as ZAYA_<COMMAND>_<OPTION>; the command line wins."""

from __future__ import annotations

import pytest

from command_line.environment import command_options, environment_name
from command_line.flags import flag_values, model_flags
from server.settings import Settings
from zaya_cli.main import build_parser, main
from zaya_model.pretrain.settings import PretrainSettings


def test_an_option_from_the_environment_is_used_and_a_flag_overrides_it(monkeypatch, tmp_path):
    monkeypatch.setenv("ZAYA_DATA_SAMPLE_CASES", "7")
    monkeypatch.setenv("ZAYA_DATA_SAMPLE_OUTPUT", str(tmp_path / "from-env"))
    assert main(["data", "sample", "--validation-cases", "3"]) == 0
    assert len((tmp_path / "from-env" / "train.jsonl").read_text().splitlines()) == 7

    assert main(["data", "sample", "--cases", "4", "--output", str(tmp_path / "flag"), "--validation-cases", "3"]) == 0
    assert len((tmp_path / "flag" / "train.jsonl").read_text().splitlines()) == 4


def test_generated_settings_flags_and_switches_read_the_environment(monkeypatch):
    monkeypatch.setenv("ZAYA_PRETRAIN_MAX_STEPS", "12")
    monkeypatch.setenv("ZAYA_FINETUNE_DRY_RUN", "yes")
    monkeypatch.setenv("ZAYA_FINETUNE_NO_MEASURE", "true")
    parser = build_parser()
    pretrain = parser.parse_args(["pretrain", "--data", "corpus.jsonl", "--output", "out"])
    assert flag_values(model_flags(PretrainSettings), pretrain) == {"max_steps": 12}
    given = parser.parse_args(["pretrain", "--data", "corpus.jsonl", "--output", "out", "--max-steps", "3"])
    assert flag_values(model_flags(PretrainSettings), given) == {"max_steps": 3}
    finetune = parser.parse_args(["finetune", "--model", "m", "--train", "t.jsonl"])
    assert finetune.dry_run is True and finetune.measure is False


def test_a_switch_with_a_word_that_is_not_true_or_false_is_refused(monkeypatch):
    monkeypatch.setenv("ZAYA_FINETUNE_DRY_RUN", "maybe")
    with pytest.raises(Exception, match="not true or false"):
        build_parser()


def test_the_environment_satisfies_a_required_option(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["data", "sample", "--cases", "5"])
    assert "--output" in capsys.readouterr().err
    monkeypatch.setenv("ZAYA_DATA_SAMPLE_OUTPUT", str(tmp_path))
    assert main(["data", "sample", "--cases", "5", "--validation-cases", "3"]) == 0
    assert (tmp_path / "train.jsonl").is_file()


def test_no_command_option_shares_a_name_with_a_server_setting():
    settings_names = {f"ZAYA_{name}".upper() for name in Settings.model_fields}
    sections = [
        f"ZAYA_{name}_".upper()
        for name, field in Settings.model_fields.items()
        if hasattr(field.annotation, "model_fields")
    ]
    clashes = []
    for command, action in command_options(build_parser()):
        name = environment_name(command, action)
        if name in settings_names or name.startswith(tuple(sections)):
            clashes.append(name)
    assert clashes == []
