"""The routers' balancing-bias update during full fine-tuning, as a `transformers.Trainer` callback.

Pretraining updates the aux-loss-free balancing biases after every optimizer step (`BalancingBiasUpdater`); a full
fine-tuning run trains the same weights, so it keeps the routing balanced the same way. A LoRA run does not: the
base weights, biases included, stay frozen and only the adapter is saved, so an adapter never changes the routing
biases of the base model it is loaded on.

The updater's AdamW state lives in each checkpoint (`balancing_optimizer.pt`) so a resumed run continues exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from zaya_model.training.balancing import BalancingBiasUpdater

BALANCING_STATE_FILE = "balancing_optimizer.pt"


class BalancingBiasCallback(TrainerCallback):
    """Calls `BalancingBiasUpdater.step()` after every optimizer step; `last_stats` holds its latest load report."""

    def __init__(self, model: torch.nn.Module, lr: float):
        self.updater = BalancingBiasUpdater(model, lr=lr)
        self.last_stats: dict[str, list[list[float]] | list[float] | float] | None = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.last_stats = self.updater.step()

    def save(self, directory: Path) -> None:
        torch.save(self.updater.state_dict(), directory / BALANCING_STATE_FILE)

    def load(self, directory: Path) -> None:
        """Restore the updater's state from a checkpoint; one written without it (LoRA) leaves a fresh state."""
        path = Path(directory) / BALANCING_STATE_FILE
        if path.is_file():
            self.updater.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
