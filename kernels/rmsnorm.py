"""Fused residual-add + RMSNorm: one pass over each row instead of three.

``y = (x + residual) / sqrt(mean((x + residual)^2) + eps) * weight``; the sum
``x + residual`` is also returned, because the next layer adds to it (the
pre-norm transformer's residual stream). Without a residual it is plain
RMSNorm. Statistics are taken in float32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # the residual stream keeps the input dtype, as the unfused model would
        tl.store(residual_out_ptr + row * stride_ro + offs,
                 x.to(residual_out_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (x * rstd * w).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gives norm(x) or, with a residual, (norm(x + residual), x + residual)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n_rows, n_cols = x2.shape
    out = torch.empty_like(x2)
    res2 = residual.reshape(-1, n_cols) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    if n_rows:
        _rmsnorm_kernel[(n_rows,)](
            x2, res2, weight, out, res_out,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0), n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols),
            num_warps=4 if n_cols <= 2048 else 8,
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gives the same result with plain torch ops in float32."""
    h = x.float() if residual is None else x.float() + residual.float()
    out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return out if residual is None else (out, h.to(x.dtype))
