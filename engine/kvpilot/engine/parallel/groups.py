"""A rank's tensor-parallel group: its place in the group, the shard arithmetic, and the
collectives the sharded layers call.

`SINGLE_RANK` (size 1) is the single-rank engine: every collective is the identity and
no layer sees torch.distributed. The process groups themselves come from
`parallel.distributed.init_distributed`; small all-reduces go over torch symmetric memory
where `parallel.symm_mem_all_reduce` set that up, over the group's backend otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from kvpilot.engine.parallel.all_reduce_choice import NCCL


class SmallAllReduce(Protocol):
    """The group's all-reduce of small messages beside its backend's (torch symmetric memory:
    `symm_mem_all_reduce.SymmMemAllReduce`, which is built over a `TPGroup`)."""

    def choose(self, x: torch.Tensor) -> str:
        """Gives the algorithm `x` takes (NCCL: the group's backend, not this)."""
        ...

    def all_reduce(self, x: torch.Tensor, algorithm: str) -> torch.Tensor:
        """Gives `x` summed over the group, in place, by `algorithm`."""
        ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Gives (norm(sum(x) + residual), sum(x) + residual) in one kernel, or None."""
        ...


def shard_slice(total: int, rank: int, size: int) -> slice:
    """Gives the part of `total` items rank `rank` of `size` holds (size divides total)."""
    part = total // size
    return slice(rank * part, (rank + 1) * part)


@dataclass(frozen=True)
class TPGroup:
    """This rank's tensor-parallel group; `expert_size` ranks split each MoE layer's experts."""

    rank: int = 0
    size: int = 1
    expert_size: int = 1
    group: dist.ProcessGroup | None = None  # None: one rank (or a model built only to inspect)
    symm_mem: SmallAllReduce | None = None  # None: every all-reduce over `group`

    @property
    def is_first(self) -> bool:
        """Gives whether this rank samples (it receives the gathered logits)."""
        return self.rank == 0

    def kv_heads(self, num_kv_heads: int) -> slice:
        """Gives the KV heads this rank holds: its share, or the one head it replicates
        when the group is larger than the KV heads (whole multiples, see config.validate)."""
        if self.size <= num_kv_heads:
            return shard_slice(num_kv_heads, self.rank, self.size)
        head = self.rank // (self.size // num_kv_heads)
        return slice(head, head + 1)

    def experts(self, num_experts: int) -> slice:
        """Gives the experts whose weights this rank holds (all of them when EP is 1)."""
        per_group = self.size // self.expert_size  # ranks that share one expert group
        return shard_slice(num_experts, self.rank // per_group, self.expert_size)

    def expert_rows(self, intermediate_size: int) -> slice:
        """Gives the slice of each local expert's intermediate size this rank holds."""
        per_group = self.size // self.expert_size
        return shard_slice(intermediate_size, self.rank % per_group, per_group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Gives `x` summed over the group, in place (the identity on one rank)."""
        if self.size > 1:
            if self.symm_mem is not None and (algorithm := self.symm_mem.choose(x)) != NCCL:
                return self.symm_mem.all_reduce(x, algorithm)
            dist.all_reduce(x, group=self.process_group())
        return x

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                                weight: torch.Tensor, eps: float
                                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Gives (norm(sum(x) + residual), sum(x) + residual) from one fused kernel over
        symmetric memory, or None where that kernel does not take `x` (the caller sums with
        `all_reduce`, then normalises)."""
        if self.symm_mem is None:
            return None
        return self.symm_mem.add_rms_norm(x, residual, weight, eps)

    def gather_first(self, x: torch.Tensor) -> torch.Tensor:
        """Gives the ranks' `x` [N, k] side by side, [N, size * k], on rank 0; other ranks
        get their own `x` back (they do not sample)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        group = self.process_group()
        dist.gather(x, parts, dst=dist.get_global_rank(group, 0), group=group)
        return torch.cat(parts, dim=-1) if parts is not None else x

    def process_group(self) -> dist.ProcessGroup:
        """Gives the group's device process group (raises when the model was built without)."""
        if self.group is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} of {self.size} has no process "
                               "group: build the model after init_distributed")
        return self.group


SINGLE_RANK = TPGroup()  # the single-rank engine: no process group, no collectives
