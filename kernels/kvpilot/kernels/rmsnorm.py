"""Fused residual-add + RMSNorm: one pass over each row instead of three.

``h = x + residual``, ``y = weight * (h / sqrt(mean(h^2) + eps))``; ``h`` is also
returned, because the next layer adds to it (the pre-norm transformer's
residual stream). Without a residual it is plain RMSNorm. Rounding follows
Hugging Face's unfused modules step for step (the sum rounded to the input
dtype, statistics in float32, the normalised row rounded before the weight
multiplies it), so swapping this kernel in leaves a model's output bit-equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit
from kvpilot.kernels.pdl import pdl_args, wait_for_previous


@jit
def _rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_xt, stride_xh, num_heads, stride_r, stride_o, stride_ro, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    # the weight is loaded with the row, not after the row's sum (a round trip fewer)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # rows of a [T, heads, d] view (Qwen3's per-head q/k norm on a slice of the fused qkv
    # output) are read in place, saving the copy a reshape would make
    x_row = x_ptr + (row // num_heads) * stride_xt + (row % num_heads) * stride_xh
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # the residual stream keeps the input dtype, as the unfused model would
        h = (x + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, h, mask=mask)
        x = h.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs,
             normed_row(x, w, n_cols, eps, out_ptr.dtype.element_ty), mask=mask)


@jit
def normed_row(x, w, n_cols, eps, DTYPE: tl.constexpr):
    """Gives w * x / rms(x) in `DTYPE` for one float32 row `x` (zero past the row's end) and
    its float32 weight `w` (loaded by the caller before the row's sum, so that its load is
    in flight with the row's), the normalised row rounded to `DTYPE` before the weight
    multiplies it, as HF's module does."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = (x * rstd).to(DTYPE).to(tl.float32)
    return (normed * w).to(DTYPE)


def rms_norm(
    x: torch.Tensor,  # [T, hidden], or [T, heads, head_dim] normed per head
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gives norm(x) or, with a residual, (norm(x + residual), x + residual)."""
    shape, n_cols = x.shape, x.shape[-1]
    x3 = x if x.dim() == 3 and x.stride(2) == 1 else x.reshape(-1, 1, n_cols)
    n_rows = x3.shape[0] * x3.shape[1]
    out = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    res2 = residual.reshape(-1, n_cols) if residual is not None else out
    res_out = torch.empty_like(out) if residual is not None else out
    if n_rows:
        _rmsnorm_kernel[(n_rows,)](
            x3, res2, weight, out, res_out,
            x3.stride(0), x3.stride(1), x3.shape[1], res2.stride(0), out.stride(0),
            res_out.stride(0), n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols),
            num_warps=4 if n_cols <= 2048 else 8, **pdl_args(x3),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gives the same result the way Hugging Face's modules compute it."""
    h = x if residual is None else x + residual
    h32 = h.float()
    out = weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, h)
