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
        """Update every router's biases from the counts gathered since the last step; return load statistics.

        Every router's statistics are computed in one stacked tensor and read back to the host in one transfer: per
        router the small ops and host reads were a measurable share of a small model's step. A router without counts,
        or with none routed, is left out (no bias update; its zero counts stay)."""
        counted = [router for router in self.routers if router.routed_token_counts is not None]
        loads: list[list[float]] = []
        skip_rates: list[float] = []
        imbalances: list[float] = []
        for router in self.routers:
            router.balancing_biases.grad = None
        if counted:
            counts = torch.stack([router.routed_token_counts for router in counted])  # type: ignore[misc]
            counts = counts.to(counted[0].balancing_biases.device)
            totals = counts.sum(dim=1, keepdim=True)
            fractions = counts / totals
            errors = fractions - torch.tensor([1.0 / router.num_experts for router in counted]).unsqueeze(1)
            if not self.include_skip:
                errors[:, -1] = 0.0
            expert_loads = fractions[:, :-1]
            imbalance = expert_loads.amax(dim=1) / expert_loads.mean(dim=1).clamp_min(1e-12)
            rows = torch.cat([totals, fractions, imbalance.unsqueeze(1)], dim=1).tolist()
            for router, error, (total, *router_fractions, router_imbalance) in zip(counted, errors, rows, strict=True):
                if total == 0:
                    continue
                router.balancing_biases.grad = error.to(router.balancing_biases.dtype)
                loads.append(router_fractions[:-1])
                skip_rates.append(router_fractions[-1])
                imbalances.append(router_imbalance)
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
