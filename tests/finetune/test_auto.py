"""The "auto" hyperparameter rule (`finetune.auto.resolve_hyperparameters`)."""

from __future__ import annotations

import math

import pytest

from finetune.auto import REFERENCE_WIDTH, auto_learning_rate, resolve_hyperparameters
from finetune.settings import BASE_LEARNING_RATE, FineTuneSettings
from zaya_model import ZayaConfig


def config(hidden_size: int) -> ZayaConfig:
    return ZayaConfig(hidden_size=hidden_size)


def test_epochs_and_batch_follow_the_dataset_size():
    auto = FineTuneSettings()
    assert [resolve_hyperparameters(auto, n).batch_size for n in (100, 999, 1_000, 2_000, 8_000, 100_000)] == [
        1, 1, 2, 4, 16, 32,
    ]  # fmt: skip
    assert [resolve_hyperparameters(auto, n).n_epochs for n in (100, 600, 1_000, 2_000, 10_000, 100_000)] == [
        25, 5, 3, 3, 2, 1,
    ]  # fmt: skip


def test_learning_rate_scales_with_the_model_width():
    lora, full = FineTuneSettings(), FineTuneSettings.from_options(method="full")
    assert auto_learning_rate(lora, config(REFERENCE_WIDTH)) == BASE_LEARNING_RATE["lora"]
    assert auto_learning_rate(full, config(4096)) == BASE_LEARNING_RATE["full"]  # never below the base rate
    assert math.isclose(auto_learning_rate(lora, config(256)), 8 * BASE_LEARNING_RATE["lora"])
    assert math.isclose(auto_learning_rate(full, config(128)), 16 * BASE_LEARNING_RATE["full"])
    assert math.isclose(auto_learning_rate(lora, config(16)), 32 * BASE_LEARNING_RATE["lora"])  # capped
    resolved = resolve_hyperparameters(lora, 500, config(128))
    assert math.isclose(resolved.learning_rate, 16 * BASE_LEARNING_RATE["lora"])
    doubled = resolve_hyperparameters(FineTuneSettings.from_options(learning_rate_multiplier=2.0), 500, config(128))
    assert math.isclose(doubled.learning_rate, 2 * resolved.learning_rate)


@pytest.mark.parametrize(
    ("r", "alpha", "factor"),
    [(8, 16.0, 1.0), (32, 32.0, 1.0), (16, 16.0, math.sqrt(2)), (2, 16.0, 0.5), (64, 8.0, 4.0), (1, 64.0, 0.25)],
)
def test_lora_rate_follows_alpha_over_sqrt_rank(r, alpha, factor):
    settings = FineTuneSettings.from_options(lora_r=r, lora_alpha=alpha)
    assert math.isclose(auto_learning_rate(settings, config(REFERENCE_WIDTH)), factor * BASE_LEARNING_RATE["lora"])


def test_explicit_values_are_kept():
    settings = FineTuneSettings.from_options(n_epochs=7, batch_size=3, learning_rate_multiplier=0.5)
    resolved = resolve_hyperparameters(settings, 10_000, config(REFERENCE_WIDTH))
    assert (resolved.n_epochs, resolved.batch_size) == (7, 3)
    assert math.isclose(resolved.learning_rate, 0.5 * BASE_LEARNING_RATE["lora"])
