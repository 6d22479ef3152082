"""The attention-backend interface every model layer calls."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.kernels.qk_norm_rotary import QKNormRope


@dataclass(frozen=True)
class QKNormStep:
    """A Qwen3 layer's q/k norms and rotary with this step's KV-cache write, left to the
    backend: `kernel` has `qk_norm_rotary`'s signature (the layer's seam), `norm` the rest of
    its arguments. The backend runs it before attending, or does the same work inside its
    decode kernel where that gives the kernel's bits (the Triton backend)."""

    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    norm: QKNormRope

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
            meta: AttentionMetadata, kv_scales: tuple[float, float]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gives (q, k) normed and rotated in place, having cached the step's k and v."""
        n = self.norm
        return self.kernel(n.positions, q, k, n.q_weight, n.k_weight, n.eps, n.cos_sin,
                           v=v, kv_cache=kv_cache, slot_mapping=meta.slot_mapping,
                           kv_scales=kv_scales)


class AttentionBackend(Protocol):
    """Writes a step's new K/V into the paged cache and attends over each sequence's context."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        # (k, v) scales of an fp8 cache: it stores k / k_scale and v / v_scale
        kv_scales: tuple[float, float] = (1.0, 1.0),
        # the caller cached this step's k, v already (a fused kernel before attention)
        kv_written: bool = False,
        # q and k still want their norms and rotary, and the step's k, v their cache write:
        # the backend does both (`QKNormStep`)
        qk_norm: QKNormStep | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim], causal within each sequence
        ...
