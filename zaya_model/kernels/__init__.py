"""Accelerated implementations beside the reference model (`zaya_model.modeling_zaya`).

The reference computes everything with plain torch and runs on any device. A kernel here computes the same thing
faster somewhere, and is registered the way transformers registers its own, so that it is chosen by name and never
runs unless asked for:
- experts implementations go to transformers' `ALL_EXPERTS_FUNCTIONS` and are picked with
  `model.set_experts_implementation(name)` (or `from_pretrained(..., experts_implementation=name)`). Each is called
  as `ZayaExperts.forward` is: `(experts, hidden_states [tokens, H], top_k_index [tokens, 1], top_k_weights
  [tokens, 1]) -> [tokens, H]`, a token routed to the skip class coming as index E (it outputs zero).

Importing this package registers every kernel. Each has a test of equality with the reference. Who applies them:
the local engine, the trainers' `--compile`, the benchmarks.

Kernels:
- `gathered` (experts): each token reads its own expert's weights by index: fixed shapes and no host step, so a
  compiled graph holds the experts (eagerly it runs the reference). Pays in compiled decode steps on CPU.
- `zaya_grouped_mm` (experts): two `F.grouped_mm` calls with no host synchronisation. The GPU path of the MoE half.
"""

from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from .gathered_experts import gathered_experts_forward
from .grouped_mm_experts import grouped_mm_experts_forward

EXPERTS_IMPLEMENTATIONS = {"gathered": gathered_experts_forward, "zaya_grouped_mm": grouped_mm_experts_forward}

for _name, _forward in EXPERTS_IMPLEMENTATIONS.items():
    ALL_EXPERTS_FUNCTIONS.register(_name, _forward)

__all__ = ["EXPERTS_IMPLEMENTATIONS", "gathered_experts_forward", "grouped_mm_experts_forward"]
