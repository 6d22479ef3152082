"""The attention-backend interface every model layer calls."""

from __future__ import annotations

from typing import Protocol

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata


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
        # where the output goes ([T, num_heads, head_dim]; None: a new tensor): a piecewise
        # graph reads it from a fixed address
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim] (`out` when given), causal within each sequence
        ...
