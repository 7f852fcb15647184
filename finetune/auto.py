""" "auto" hyperparameters: the numbers a run uses for the settings left on "auto".

`resolve_hyperparameters` is the one place that turns "auto" into numbers, from the settings, the dataset (its
validation report: examples and tokens) and the model's config. The trainer calls it once the dataset is validated
and reports the result in its events; `zaya finetune --dry-run` and the API's estimate call it too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .settings import BASE_LEARNING_RATE, FineTuneSettings

if TYPE_CHECKING:
    from zaya_model import ZayaConfig

# "auto" epochs: aim for this many examples seen in total, within [1, MAX_AUTO_EPOCHS] (as OpenAI's API does)
MIN_TARGET_EXAMPLES, MAX_TARGET_EXAMPLES, DEFAULT_EPOCHS, MAX_AUTO_EPOCHS = 3_000, 25_000, 3, 25
DEFAULT_BETA = 0.1  # TRL's and the DPO paper's default


@dataclass(frozen=True)
class ResolvedHyperparameters:
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    learning_rate: float
    beta: float | None = None  # DPO only

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


def resolve_hyperparameters(settings: FineTuneSettings, n_examples: int, config: ZayaConfig | None = None):
    """Turn "auto" into numbers from the dataset size: batch ~0.2% of the examples (power of two, at most 32),
    epochs so that 3,000–25,000 examples are seen (default 3), learning-rate multiplier 1, DPO beta 0.1.

    `config` (the base model's) is there for rules that depend on the model's width."""
    hyper = settings.hyperparameters
    batch_size = hyper.batch_size
    if batch_size == "auto":
        batch_size = min(32, 2 ** int(math.log2(max(1, n_examples // 500))))
    n_epochs = hyper.n_epochs
    if n_epochs == "auto":
        n_epochs = DEFAULT_EPOCHS
        if n_examples * n_epochs < MIN_TARGET_EXAMPLES:
            n_epochs = min(MAX_AUTO_EPOCHS, math.ceil(MIN_TARGET_EXAMPLES / max(n_examples, 1)))
        elif n_examples * n_epochs > MAX_TARGET_EXAMPLES:
            n_epochs = max(1, MAX_TARGET_EXAMPLES // n_examples)
    multiplier = 1.0 if hyper.learning_rate_multiplier == "auto" else float(hyper.learning_rate_multiplier)
    beta = None
    if settings.type == "dpo":
        beta = DEFAULT_BETA if hyper.beta == "auto" else float(hyper.beta)
    return ResolvedHyperparameters(
        n_epochs=int(n_epochs),
        batch_size=int(batch_size),
        learning_rate_multiplier=multiplier,
        learning_rate=BASE_LEARNING_RATE[settings.adapter] * multiplier,
        beta=beta,
    )
