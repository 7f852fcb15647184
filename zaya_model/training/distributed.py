"""Data-parallel training helpers: the process group, and the few collectives a replicated training step needs.

Every rank holds the full model and optimizer state (DDP-style replication). Gradients are summed across ranks
in one flattened all-reduce after the local backward passes, so with each rank's loss normalised by the global
token count, N ranks with batch b compute exactly the gradient of one rank with batch N*b (up to summation order).
Launch with `torchrun --nproc-per-node N`; a single process needs no set-up at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedContext:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_environment(cls) -> DistributedContext:
        """Join the process group torchrun describes in the environment (or run alone when there is none)."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls()
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        return cls(dist.get_rank(), dist.get_world_size())

    def device(self) -> torch.device:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if self.enabled else 0)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over ranks, in place."""
        if self.enabled:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def max(self, value: int) -> int:
        """The largest `value` over ranks, on every rank (so all ranks take the same branch)."""
        if not self.enabled:
            return value
        tensor = torch.tensor([value], device=self.device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def sum_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over ranks in one flattened all-reduce (missing gradients count as 0)."""
        if not self.enabled:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for parameter in parameters:
            count = parameter.numel()
            parameter.grad = flat[offset : offset + count].view_as(parameter).clone()
            offset += count
