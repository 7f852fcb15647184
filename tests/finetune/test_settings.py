"""`FineTuneSettings`: one model for the API's `method`, `zaya finetune`'s flags and the worker, with one set of
defaults and errors named by the model's own fields."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from command_line.flags import FlagError
from finetune.settings import (
    FineTuneSettings,
    add_settings_flags,
    cli_flags,
    settings_from_flags,
)
from server.api.routes.fine_tuning import JobCreate


def parse(argv: list[str]) -> FineTuneSettings:
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    return settings_from_flags(parser.parse_args(argv))


def leaf_paths(model: type, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    paths = set()
    for name, field in model.model_fields.items():
        nested = [
            arg
            for arg in (field.annotation, *getattr(field.annotation, "__args__", ()))
            if hasattr(arg, "model_fields")
        ]
        paths |= leaf_paths(nested[0], (*prefix, name)) if nested else {(*prefix, name)}
    return paths


def test_every_setting_has_a_flag_and_no_flag_is_hand_written():
    assert {flag.path for flag in cli_flags()} == leaf_paths(FineTuneSettings)
    for method in ("supervised", "dpo"):  # within one method, one flag per setting
        dests = [flag.dest for flag in cli_flags() if flag.path[0] in ("type", method)]
        assert len(dests) == len(set(dests))


def test_no_flags_give_the_api_defaults():
    assert parse([]) == FineTuneSettings() == JobCreate(model="m", training_file="f").effective_method()
    assert parse(["--type", "dpo"]) == FineTuneSettings.model_validate({"type": "dpo"})


def test_flags_and_api_json_and_python_options_build_the_same_settings():
    flags = parse(["--n-epochs", "2", "--learning-rate-multiplier", "0.5", "--method", "full", "--no-packing"])
    api = FineTuneSettings.model_validate(
        {
            "type": "supervised",
            "supervised": {
                "adapter": "full",
                "hyperparameters": {"n_epochs": 2, "learning_rate_multiplier": 0.5, "packing": False},
            },
        }
    )
    options = FineTuneSettings.from_options(n_epochs=2, learning_rate_multiplier=0.5, method="full", packing=False)
    assert flags == api == options
    dpo = parse(["--type", "dpo", "--beta", "0.2", "--lora-r", "4", "--lora-target-modules", "q_proj", "o_proj"])
    assert dpo.hyperparameters.beta == 0.2 and dpo.lora.r == 4 and dpo.lora.target_modules == ["q_proj", "o_proj"]
    assert dpo == FineTuneSettings.from_options(
        type="dpo", beta=0.2, lora_r=4, lora_target_modules=["q_proj", "o_proj"]
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--n-epochs", "0"], '--n-epochs: Input should be "auto" or an integer from 1 to 100'),
        (["--batch-size", "big"], '--batch-size: Input should be "auto" or an integer from 1 to 1024'),
        (["--lora-dropout", "1"], "--lora-dropout: Input should be less than 1"),
        (["--method", "full", "--merge-adapter"], "--merge-adapter: only a LoRA run has an adapter to merge"),
        (["--beta", "0.1"], "--beta: only applies with --type dpo"),
        (["--packing", "--type", "dpo"], "--packing: only applies with --type supervised"),
    ],
)
def test_a_bad_flag_is_named(argv, message):
    with pytest.raises(FlagError) as error:
        parse(argv)
    assert str(error.value).startswith(message)


def test_api_values_are_strict_and_auto_stays_representable():
    assert FineTuneSettings().hyperparameters.n_epochs == "auto"
    with pytest.raises(ValidationError):
        FineTuneSettings.model_validate({"supervised": {"hyperparameters": {"n_epochs": "3"}}})  # JSON's "3" is text
    stored = FineTuneSettings.from_options(type="dpo", beta=0.3).model_dump()
    assert FineTuneSettings.model_validate(stored) == FineTuneSettings.from_options(type="dpo", beta=0.3)


def test_template_token_rows_are_a_supervised_lora_setting():
    assert FineTuneSettings().lora.trains_template_tokens
    assert not FineTuneSettings.model_validate({"type": "dpo"}).lora.trains_template_tokens
    with pytest.raises(ValidationError, match="train_template_tokens"):
        FineTuneSettings.model_validate({"type": "dpo", "dpo": {"lora": {"train_template_tokens": True}}})
