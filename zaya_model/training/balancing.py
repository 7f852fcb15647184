"""The balancing-bias update of ZAYA's aux-loss-free load balancing (spec §4.3).

The router picks `argmax(p + b)`; the biases `b` are not trained by backprop. The updater hooks the model
(`RoutedTokenCounter`): each training forward then adds each router's routed-token counts to
`router.routed_token_counts`. After each optimizer step call
`BalancingBiasUpdater.step()`, which feeds AdamW the error `p̂_e − 1/E` (fraction of tokens routed to expert e minus
the uniform share) as the biases' gradient, so over-used experts' biases go down and under-used ones go up.

The skip class is left out by default: its rate is learned by the router itself and its bias stays at its
initial value; `include_skip=True` balances it towards `1/E` like an expert.
"""

from __future__ import annotations

import torch

from ..modeling_zaya import RoutedTokenCounter, ZayaRouter


class BalancingBiasUpdater:
    def __init__(
        self,
        model: torch.nn.Module,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        include_skip: bool = False,
    ):
        self.routers = [module for module in model.modules() if isinstance(module, ZayaRouter)]
        if not self.routers:
            raise ValueError("The model has no ZAYA routers to balance.")
        self.counter = RoutedTokenCounter.install(model)
        self.include_skip = include_skip
        self.optimizer = torch.optim.AdamW(
            [router.balancing_biases for router in self.routers], lr=lr, betas=betas, weight_decay=0.0
        )

    @torch.no_grad()
    def step(self) -> dict[str, list[list[float]] | list[float] | float]:
        """Update every router's biases from the counts gathered since the last step; return load statistics."""
        loads: list[list[float]] = []
        skip_rates: list[float] = []
        imbalances: list[float] = []
        for router in self.routers:
            counts = router.routed_token_counts
            bias = router.balancing_biases
            if counts is None or counts.sum() == 0:
                bias.grad = None
                continue
            fractions = counts.to(bias.device) / counts.sum()
            error = fractions - 1.0 / router.num_experts
            if not self.include_skip:
                error[-1] = 0.0
            bias.grad = error.to(bias.dtype)
            expert_load = fractions[:-1]
            loads.append(expert_load.tolist())
            skip_rates.append(fractions[-1].item())
            imbalances.append((expert_load.max() / expert_load.mean().clamp_min(1e-12)).item())
            router.routed_token_counts = None
        self.optimizer.step()
        for router in self.routers:
            router.balancing_biases.grad = None
        return {
            "expert_load": loads,
            "skip_rate": skip_rates,
            "load_imbalance": imbalances,
            "max_load_imbalance": max(imbalances, default=0.0),
        }

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
