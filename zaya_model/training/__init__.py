"""Training pieces shared by pretraining and fine-tuning."""

from .balancing import BalancingBiasUpdater
from .checkpointing import Checkpointer

__all__ = ["BalancingBiasUpdater", "Checkpointer"]
