""" "auto" hyperparameters: the numbers a run uses for the settings left on "auto".

`resolve_hyperparameters` is the one place that turns "auto" into numbers, from the settings, the dataset (its
validation report: examples and tokens) and the model's config. The trainer calls it once the dataset is validated
and reports the result in its events; `zaya finetune --dry-run` and the API's estimate call it too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .settings import BASE_LEARNING_RATE, DpoHyperparameters, FineTuneSettings, LoraSettings

if TYPE_CHECKING:
    from zaya_model import ZayaConfig

# "auto" epochs: aim for this many examples seen in total, within [1, MAX_AUTO_EPOCHS] (as OpenAI's API does)
MIN_TARGET_EXAMPLES, MAX_TARGET_EXAMPLES, DEFAULT_EPOCHS, MAX_AUTO_EPOCHS = 3_000, 25_000, 3, 25
DEFAULT_BETA = 0.1  # TRL's and the DPO paper's default
# The width the base learning rates are set for (ZAYA1-base's hidden size); narrower models get larger rates.
REFERENCE_WIDTH = 2048
MAX_WIDTH_FACTOR = 32.0
# The LoRA shape the base rate is set for: a LoRA update scales as alpha / sqrt(r) (rsLoRA).
REFERENCE_LORA_SCALE = LoraSettings().alpha / math.sqrt(LoraSettings().r)
LORA_SCALE_FACTOR_RANGE = (0.25, 4.0)


@dataclass(frozen=True)
class ResolvedHyperparameters:
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    learning_rate: float
    beta: float | None = None  # DPO only

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


def auto_learning_rate(settings: FineTuneSettings, config: ZayaConfig | None = None) -> float:
    """The learning rate before the multiplier: the adapter kind's base rate (LoRA 2e-4, full 2e-5: the usual rates
    for a 2048-wide model), x REFERENCE_WIDTH / hidden_size (at most 32x), since with Adam a weight's update is
    about the learning rate whatever the width, so a narrower model needs a larger rate for the same change in its
    outputs; for LoRA also x (16 / sqrt(8)) / (alpha / sqrt(r)), within [1/4, 4], since the adapter's update scales
    as alpha / sqrt(r) and the base rate is set for r 8, alpha 16."""
    rate = BASE_LEARNING_RATE[settings.adapter]
    if config is not None:
        rate *= min(MAX_WIDTH_FACTOR, max(1.0, REFERENCE_WIDTH / config.hidden_size))
    if settings.adapter == "lora":
        low, high = LORA_SCALE_FACTOR_RANGE
        scale = settings.lora.alpha / math.sqrt(settings.lora.r)
        rate *= min(high, max(low, REFERENCE_LORA_SCALE / scale))
    return rate


def resolve_hyperparameters(
    settings: FineTuneSettings, n_examples: int, config: ZayaConfig | None = None
) -> ResolvedHyperparameters:
    """Turn "auto" into numbers from the dataset and the model:

    - batch size: ~0.2% of the examples, a power of two from 1 to 32;
    - epochs: 3, raised so that at least 3,000 examples are seen (at most 25 epochs) or lowered so that at most
      25,000 are (at least 1);
    - learning rate: `auto_learning_rate` (the adapter kind's base rate, scaled to the model's width and, for
      LoRA, to the adapter's rank and alpha) x the multiplier (auto: 1);
    - DPO beta: 0.1.
    """
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
    if isinstance(hyper, DpoHyperparameters):
        beta = DEFAULT_BETA if hyper.beta == "auto" else float(hyper.beta)
    return ResolvedHyperparameters(
        n_epochs=int(n_epochs),
        batch_size=int(batch_size),
        learning_rate_multiplier=multiplier,
        learning_rate=auto_learning_rate(settings, config) * multiplier,
        beta=beta,
    )
