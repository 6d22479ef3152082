"""SiLU-and-mul: the gated MLP's ``silu(gate) * up`` in one pass.

The input is the fused gate/up projection ``[T, 2 * I]`` (gate first); the
output is ``[T, I]``. Math in float32, stored in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit
from kvpilot.kernels.pdl import pdl_args, wait_for_previous


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gives silu(x[..., :I]) * x[..., I:] with I = x.shape[-1] // 2."""
    n_cols = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], n_cols, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n_cols))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n_cols, block))](
            x2, out, x2.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4,
            **pdl_args(x2))
    return out.view(*x.shape[:-1], n_cols)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Gives the same result with torch.nn.functional in float32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
