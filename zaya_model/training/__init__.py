"""Training pieces shared by pretraining and fine-tuning."""

from .balancing import BalancingBiasUpdater
from .checkpointing import CheckpointManager

__all__ = ["BalancingBiasUpdater", "CheckpointManager"]
