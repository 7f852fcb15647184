"""`PretrainSettings`: the presets are instances of it, `zaya pretrain`'s flags are generated from it, and a bad value
is named by its field (or flag)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from command_line.flags import FlagError, flag_error, flag_values, model_flags
from zaya_cli.main import build_parser
from zaya_model.pretrain.presets import MICRO_MODEL, get_preset
from zaya_model.pretrain.settings import PretrainSettings


def settings_from(argv: list[str]) -> PretrainSettings:
    """What `zaya pretrain` builds from its command line."""
    args = build_parser().parse_args(["pretrain", "--data", "d", "--output", "o", *argv])
    flags = model_flags(PretrainSettings)
    try:
        values = flag_values(flags, args)
        return PretrainSettings.model_validate({**get_preset(args.preset).model_dump(), **values})
    except ValidationError as error:
        raise flag_error(flags, error) from None


def test_every_setting_but_the_model_shape_has_a_flag():
    assert {flag.path[0] for flag in model_flags(PretrainSettings)} == set(PretrainSettings.model_fields) - {"model"}
    assert {flag.option for flag in model_flags(PretrainSettings)} >= {"--vocab-size", "--seq-len", "--compile"}


def test_the_preset_fills_what_the_flags_leave_out():
    assert settings_from([]) == get_preset("tiny")
    changed = settings_from(["--max-steps", "7", "--lr", "1e-3", "--optimizer", "muon", "--compile"])
    assert changed == get_preset("tiny").replace(max_steps=7, lr=1e-3, optimizer="muon", compile=True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-len", "4096"], "--seq-len: exceeds the model's max_position_embeddings (1024)"),
        (["--batch-size", "0"], "--batch-size: Input should be greater than or equal to 1"),
        (["--validation-fraction", "1"], "--validation-fraction: Input should be less than 1"),
        (["--sharding", "fsdp", "--optimizer", "muon"], "--sharding: fsdp needs optimizer adamw"),
        (["--lr", "fast"], "--lr: Input should be a valid number"),
    ],
)
def test_a_bad_flag_is_named(argv, message):
    with pytest.raises(FlagError) as error:
        settings_from(argv)
    assert str(error.value).startswith(message)


def test_settings_are_frozen_and_replace_validates():
    settings = PretrainSettings(model=MICRO_MODEL)
    with pytest.raises(ValidationError):
        settings.seq_len = 64
    with pytest.raises(ValidationError, match="seq_len"):
        settings.replace(seq_len=4096)
    assert PretrainSettings.model_validate(settings.model_dump()) == settings  # as saved in run.json
