"""Device, dtypes and error measures shared by the kernel tests (see conftest.py for the switch)."""

from __future__ import annotations

import os

import torch

ON_GPU = os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# the interpreter's bf16 arithmetic is wrong (Triton docs): CPU runs fp16/fp32 only
DTYPES = [torch.float16, torch.float32]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Gives ||out - ref|| / ||ref|| in float64; NaN anywhere (an unwritten element) fails."""
    out64, ref64 = out.double(), ref.double()
    assert not torch.isnan(out64).any(), "output holds NaN: an element was not written"
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    """Gives the relative-error bound for a dtype (METHOD.md: tf32 ~3e-4, bf16 1e-3..1e-2)."""
    return {torch.float32: 2e-3, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
