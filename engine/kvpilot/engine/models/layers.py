"""Small building blocks shared by the model files: the seams where fused kernels plug in.

Each seam holds its implementation in an attribute (`RMSNorm.kernel`, `FeedForward.act`,
`RotaryEmbedding.kernel`) that `fused.use_fused_kernels` swaps for a Triton kernel
on CUDA; the torch code here is what runs everywhere else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from kvpilot.engine.parallel.groups import TPGroup


@dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor lands on this rank: `source` (its slice of the tensor,
    () for all of it) is copied into `param[index]`; `param` None: another rank's tensor
    (an expert this rank does not hold), read by nobody here. `per_row`: a quantisation
    scale, stored as a scalar (per-tensor), [rows] or [rows, 1]; spread over `shape`'s rows."""

    param: str | None
    shape: tuple[int, ...]  # the checkpoint tensor's full shape
    index: tuple = ()
    source: tuple = ()
    per_row: bool = False


# checkpoint tensor name -> where (which slice of) it lands
WeightLayout: TypeAlias = dict[str, WeightSlot]


def rows_source(rows: slice, full: int, dim: int = 0) -> tuple:
    """Gives the WeightSlot.source taking `rows` of dimension `dim` (() when that is all)."""
    if rows.start in (0, None) and rows.stop == full:
        return ()
    return (slice(None),) * dim + (rows,)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as HF does, then scaled by `weight`;
    optionally adds the residual stream first (pre-norm transformer)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # a fused kernel with the signature of kvpilot.kernels.rmsnorm.rms_norm, or None
        self.kernel: Callable | None = None
        # set under tensor parallelism when x arrives as this rank's partial sum (a
        # row-parallel projection left its all-reduce to this norm): x is summed over the
        # group first, in one kernel with the add and the norm where the group can
        self.sum_over: TPGroup | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Gives norm(x); with `residual`, gives (norm(x + residual), x + residual)."""
        if self.sum_over is not None:
            assert residual is not None  # only norms with a residual take a partial sum
            fused = self.sum_over.all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = self.sum_over.all_reduce(x)
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gives silu(gate) * up for `x` = [gate | up] along the last dim (SwiGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class FeedForward(nn.Module, ABC):
    """A decoder layer's feed-forward block (dense MLP or mixture of experts): [T, hidden]
    in and out, with its gated activation in the `act` seam."""

    def __init__(self) -> None:
        super().__init__()
        self.act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul  # the fused-kernel seam

    @abstractmethod
    def weight_layout(self, prefix: str) -> WeightLayout:
        """Gives where the checkpoint tensors of layer `prefix` (model.layers.i) land here."""


class Linear(nn.Linear):
    """nn.Linear with its matmul in a seam, `matmul(x, weight, bias)`: F.linear, or on CUDA
    the one-row GEMV's wrapper (`fused.use_fused_kernels`) for batch-1 decode."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.matmul: Callable[..., torch.Tensor] = F.linear

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.matmul(input, self.weight, self.bias)


class MergedLinear(Linear):
    """A linear layer whose output rows stack several checkpoint matrices (q|k|v, gate|up).

    One matmul instead of several. Under tensor parallelism it is column-parallel:
    part i holds rows `sources[i]` of its `full_sizes[i]`-row checkpoint matrix (this
    rank's heads, or its slice of the intermediate size).
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 full_sizes: list[int] | None = None,
                 sources: list[slice] | None = None) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes
        self.full_sizes = full_sizes or output_sizes
        self.sources = sources or [slice(0, n) for n in output_sizes]

    def shard_rows(self, index: int) -> slice:
        """Gives the output rows of part `index`."""
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def weight_layout(self, prefix: str, merged_name: str, parts: list[str]) -> WeightLayout:
        """Gives where checkpoint tensors `prefix.<part>.weight` (and biases) land."""
        layout: WeightLayout = {}
        for i, part in enumerate(parts):
            rows, full = self.shard_rows(i), self.full_sizes[i]
            source = rows_source(self.sources[i], full)
            layout[f"{prefix}.{part}.weight"] = WeightSlot(
                f"{prefix}.{merged_name}.weight", (full, self.in_features), (rows,), source)
            if self.bias is not None:
                layout[f"{prefix}.{part}.bias"] = WeightSlot(
                    f"{prefix}.{merged_name}.bias", (full,), (rows,), source)
        return layout


def whole(name: str, param: nn.Parameter | torch.Tensor) -> WeightLayout:
    """Gives the layout of a tensor every rank holds whole (norms, the MoE router)."""
    return {name: WeightSlot(name, tuple(param.shape))}
