"""Structured outputs' token bitmask applied to a batch's logits in one pass.

`bitmask` is int32 `[N, ceil(vocab / 32)]`: bit k of word w allows token
32 * w + k. The output is `logits` `[N, vocab]` with every disallowed token at
-inf; no unpacked mask is materialised (each program reads its words and writes
its logits once). Out of place: the sampler's input stays the model's raw logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit


@jit
def _apply_token_bitmask_kernel(logits_ptr, mask_ptr, out_ptr, stride_l, stride_m, stride_o,
                                vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    words = tl.load(mask_ptr + row * stride_m + offs // 32, mask=inside, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    x = tl.load(logits_ptr + row * stride_l + offs, mask=inside, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, tl.where(allowed, x, float("-inf")), mask=inside)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Gives `logits` [N, vocab] with the tokens whose bit is 0 in `bitmask` [N, words] (int32,
    same device) set to -inf."""
    n, vocab = logits.shape
    if bitmask.shape[0] != n or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask shape {tuple(bitmask.shape)} does not cover logits "
                         f"{tuple(logits.shape)}: give [N, ceil(vocab / 32)] int32 words")
    logits, bitmask = logits.contiguous(), bitmask.contiguous()  # the kernel's rows are dense
    out = torch.empty_like(logits)
    block = 1024
    if n:
        _apply_token_bitmask_kernel[(n, triton.cdiv(vocab, block))](
            logits, bitmask, out, logits.stride(0), bitmask.stride(0), out.stride(0), vocab,
            BLOCK=block, num_warps=4)
    return out


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Gives the same result with torch (one unpacked bit per token)."""
    n, vocab = logits.shape
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).view(n, 32 * bitmask.shape[1])[:, :vocab]
    return logits.masked_fill(allowed == 0, float("-inf"))
