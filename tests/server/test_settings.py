"""One `Settings` read from `ZAYA_*` variables, with a section per engine that `create_engine` hands its engine."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.engines import create_engine
from server.settings import LocalEngineSettings, Settings, VLLMEngineSettings
from zaya_cli.main import main


def test_engine_sections_read_their_prefixed_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("ZAYA_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("ZAYA_ENGINE", "vllm")
    monkeypatch.setenv("ZAYA_LOCAL_ENGINE_MAX_BATCH_SIZE", "3")
    monkeypatch.setenv("ZAYA_LOCAL_ENGINE_MAX_QUEUED_REQUESTS", "0")
    monkeypatch.setenv("ZAYA_LOCAL_ENGINE_COMPILE", "false")
    monkeypatch.setenv("ZAYA_VLLM_DTYPE", "bfloat16")
    monkeypatch.setenv("ZAYA_VLLM_MAX_NUM_BATCHED_TOKENS", "4096")
    monkeypatch.setenv("ZAYA_VLLM_ENFORCE_EAGER", "true")
    settings = Settings()
    assert (settings.data_dir, settings.engine) == (tmp_path, "vllm")
    assert settings.local_engine == LocalEngineSettings(max_batch_size=3, max_queued_requests=0, compile=False)
    assert settings.vllm == VLLMEngineSettings(dtype="bfloat16", max_num_batched_tokens=4096, enforce_eager=True)


def test_a_bad_engine_setting_is_refused_naming_its_field(monkeypatch):
    monkeypatch.setenv("ZAYA_LOCAL_ENGINE_MAX_BATCH_SIZE", "0")
    with pytest.raises(ValidationError) as error:
        Settings()
    assert error.value.errors()[0]["loc"] == ("local_engine", "max_batch_size")


def test_create_engine_hands_the_engine_its_section(tmp_path):
    settings = Settings(data_dir=tmp_path, engine="local", local_engine=LocalEngineSettings(max_loaded_models=2))
    engine = create_engine(settings)
    assert engine.name == "local" and engine.settings is settings.local_engine


def test_zaya_commands_report_bad_settings_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("ZAYA_VLLM_MAX_NUM_SEQS", "none")
    assert main(["serve"]) == 1
    assert capsys.readouterr().err == (
        "zaya serve: error: invalid Settings: vllm.max_num_seqs: "
        "Input should be a valid integer, unable to parse string as an integer\n"
    )
