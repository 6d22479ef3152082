"""Small building blocks shared by the model files: the seams where fused kernels plug in.

Each seam holds its implementation in an attribute (`RMSNorm.kernel`, `FeedForward.act`,
`RotaryEmbedding.kernel`) that `fused.use_fused_kernels` swaps for a Triton kernel
on CUDA; the torch code here is what runs everywhere else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TypeAlias

import torch
from torch import nn
from torch.nn import functional as F

# checkpoint tensor name -> (parameter name, index into that parameter)
WeightLayout: TypeAlias = dict[str, tuple[str, tuple]]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as HF does, then scaled by `weight`;
    optionally adds the residual stream first (pre-norm transformer)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # a fused kernel with the signature of kvpilot.kernels.rmsnorm.rms_norm, or None
        self.kernel: Callable | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Gives norm(x); with `residual`, gives (norm(x + residual), x + residual)."""
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
