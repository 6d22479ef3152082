"""Small building blocks shared by the model files: the seams where fused kernels plug in."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as HF does, then scaled by `weight`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Gives `x` normalised over its last dim, in `x`'s dtype."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gives silu(gate) * up for `x` = [gate | up] along the last dim (SwiGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class MergedLinear(nn.Linear):
    """A linear layer whose output rows stack several checkpoint matrices (q|k|v, gate|up).

    One matmul instead of several; `shard_rows` tells the loader which rows each
    checkpoint tensor fills.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def shard_rows(self, index: int) -> slice:
        """Gives the output rows of shard `index`."""
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])
