"""Training pieces shared by pretraining and fine-tuning."""

from .balancing import BalancingBiasUpdater

__all__ = ["BalancingBiasUpdater"]
