"""Rotary position embeddings, neox style (rotate halves), with Llama 3 and linear scaling."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: dict[str, Any] | None) -> torch.Tensor:
    """Gives the float32 inverse frequencies [head_dim // 2] that HF computes for this rope."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(
        f"rope_scaling.rope_type={rope_type!r} in config.json is not supported: kvpilot "
        "implements default, linear and llama3")


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent stretch: long wavelengths slowed by `factor`, short
    ones kept, the band between blended smoothly."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds the cos|sin table of every position up to `max_positions` (one per model)."""

    cos_sin: torch.Tensor  # [max_positions, head_dim] float32, a buffer (register_buffer)

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # float32 on purpose (model.to(dtype) would round it: keep buffers out of .to):
        # the table stays exact whatever dtype the model runs in.
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.float32)
        self.register_buffer("cos_sin", table, persistent=False)
        # a fused in-place kernel with kvpilot.kernels.rotary.rotary_embedding's signature
        self.kernel: Callable | None = None

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
        """Gives the rotation of this step's `positions` [T], shared by every layer."""
        if self.kernel is not None:
            return KernelRope(self.kernel, positions, self.cos_sin)
        cos, sin = self.cos_sin[positions].float().unsqueeze(1).chunk(2, dim=-1)
        return TorchRope(cos.to(dtype), sin.to(dtype))


@dataclass
class TorchRope:
    """Rotates with cos/sin rows [T, 1, head_dim // 2] gathered once per step."""

    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gives q [T, heads, d] and k [T, kv_heads, d] rotated."""
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)


@dataclass
class KernelRope:
    """Rotates q and k in place with a fused kernel that reads the table itself."""

    kernel: Callable
    positions: torch.Tensor
    cos_sin: torch.Tensor

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernel(self.positions, q, k, self.cos_sin)


StepRope = TorchRope | KernelRope


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Gives x [T, heads, d] rotated neox style: halves (x1, x2) -> (x1 cos - x2 sin,
    x2 cos + x1 sin), the same arithmetic as HF's rotate_half."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
