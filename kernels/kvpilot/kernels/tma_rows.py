"""What a TMA descriptor over a [tokens, heads * head_dim] view asks of a [tokens, heads,
head_dim] tensor; the prefill attention kernels that read q/k/v through TMA share it."""

from __future__ import annotations

import torch

ALIGN = 16  # bytes: TMA descriptors need 16-byte aligned base addresses and strides


def tma_rows_ok(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's heads are contiguous within a token (one 2-D row per token) with
    16-byte aligned token strides and base addresses."""
    return all(x.stride(2) == 1 and x.stride(1) == x.shape[2]
               and (x.stride(0) * x.element_size()) % ALIGN == 0 and x.data_ptr() % ALIGN == 0
               for x in tensors)
