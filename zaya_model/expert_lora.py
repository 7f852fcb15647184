"""Expert weights with LoRA kept low-rank.

PEFT adapts the fused 3-D expert weights through `target_parameters`: around each forward it parametrizes a weight
as `W + scaling * lhs @ rhs` (`lhs` [E, out, r], `rhs` [E, r, in]). Reading the parametrized weight builds a tensor
the size of the whole expert stack, and backpropagating through it computes a full-size weight gradient, so a LoRA
step would cost as much as full fine-tuning. `expert_weight` hands the experts the frozen `W` and the two factors
instead; each expert then computes `x W^T + scaling * (x rhs^T) lhs^T`, whose extra cost is rank-sized.

Registering the parametrization also evaluates it once (torch's consistency check): a `baddbmm` over every expert stack,
a noticeable share of a LoRA step. `peft_expert_weights` reads the factors from PEFT's wrappers directly when they hold
one active adapter, so the MoE block calls the experts without that registration.

Any other parametrization (several adapters at once, low-precision weights, user code) is read as PEFT defines it:
the materialised weight, with no low-rank part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from .grouped_linear import grouped_linear

try:
    from peft.tuners.lora.layer import ParamWrapper as _PeftParamWrapper
    from peft.tuners.lora.layer import _LoraFactorsProxy as _PeftLowRankProxy
except ImportError:  # PEFT absent or reorganised: every parametrization is read materialised
    _PeftLowRankProxy = _PeftParamWrapper = None  # type: ignore[assignment,misc]  # optional (private) PEFT names

# Base weight dtypes for which PEFT keeps the factors (others it upcasts and materialises).
FACTOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class ExpertWeight:
    """A stacked expert weight [E, out, in], optionally plus `scaling * lhs @ rhs` kept as factors."""

    weight: torch.Tensor
    lhs: torch.Tensor | None = None  # [E, out, r]
    rhs: torch.Tensor | None = None  # [E, r, in]
    scaling: float = 1.0

    def grouped(self, inputs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        """Rows of `inputs` sorted by expert, `group_sizes` [E] rows each -> [rows, out]."""
        output = grouped_linear(inputs, self.weight, group_sizes)
        if self.lhs is None:
            return output
        if self.rhs is None:
            raise ValueError("an ExpertWeight with `lhs` needs `rhs`")
        low_rank = grouped_linear(grouped_linear(inputs, self.rhs, group_sizes), self.lhs, group_sizes)
        return output + self.scaling * low_rank


def expert_weight(module: nn.Module, name: str) -> ExpertWeight:
    """`module.<name>` as an `ExpertWeight`, low-rank when PEFT's single-adapter parametrization is on it."""
    if not parametrize.is_parametrized(module, name):
        return ExpertWeight(getattr(module, name))
    chain = module.get_submodule(f"parametrizations.{name}")
    if (
        _PeftLowRankProxy is not None
        and isinstance(chain, parametrize.ParametrizationList)
        and len(chain) == 1
        and isinstance(proxy := chain[0], _PeftLowRankProxy)
    ):
        # Contiguous factors: the grouped matmul writes each expert's gradient into a dense [out, r] block.
        return ExpertWeight(chain.original, proxy.lhs.contiguous(), proxy.rhs.contiguous(), float(proxy.scaling))
    return ExpertWeight(getattr(module, name))


def peft_expert_weights(experts: nn.Module) -> tuple[nn.Module, dict[str, ExpertWeight]] | None:
    """For PEFT's `ParamWrapper`s around our experts (LoRA through `target_parameters`): the experts module and each
    adapted weight with its factors, as PEFT's own path would apply them (`_LoraFactorsProxy`). None where PEFT's
    path must run: not wrapped, adapters disabled or merged, several active adapters on a weight, or a
    low-precision (upcast) base weight."""
    if _PeftParamWrapper is None or not isinstance(experts, _PeftParamWrapper):
        return None
    weights = {}
    while isinstance(experts, _PeftParamWrapper):
        if experts.disable_adapters or experts.merged or not hasattr(experts, "get_delta_factors"):
            return None
        adapters = [name for name in experts.active_adapters if name in experts.lora_A]
        weight = experts.get_param()
        if len(adapters) > 1 or experts.num_experts < 2 or weight.dtype not in FACTOR_DTYPES:
            return None
        if adapters:  # no active adapter on this weight: PEFT leaves it as it is
            lhs, rhs, scaling = experts.get_delta_factors(adapters[0])
            weights[experts.parameter_name] = ExpertWeight(weight, lhs.contiguous(), rhs.contiguous(), float(scaling))
        experts = experts.base_layer
    return experts, weights
