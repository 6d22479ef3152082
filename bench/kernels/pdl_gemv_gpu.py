"""Does programmatic dependent launch shorten a CUDA graph of dependent one-row GEMVs?

32 GEMVs at Llama-3-8B's projection shapes (TP=1 and TP=2 shards), each reading the last
one's output: plain launches, then `launch_pdl=True` with the first weight tile loaded before
`gdc_wait()`, then also `gdc_launch_dependents()` right after the wait. Median us per GEMV.

    python3 bench/kernels/pdl_gemv_gpu.py      # one Hopper GPU (PDL needs compute 9.0)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from w8a16_gemv_gpu import graph_time_us


@triton.jit
def _gemv(x_ptr, w_ptr, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PDL: tl.constexpr, EARLY: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    start = 0
    if PDL:  # the first weight tile does not depend on the kernel before
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :])
        gdc_wait()
        if EARLY:
            gdc_launch_dependents()
        acc += w.to(tl.float32) * tl.load(x_ptr + offs_k).to(tl.float32)[None, :]
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
        w = tl.load(w_ptr + offs_n[:, None] * K + (k0 + offs_k)[None, :])
        acc += w.to(tl.float32) * x[None, :]
    tl.store(out_ptr + offs_n, tl.sum(acc, 1).to(out_ptr.dtype.element_ty))


def per_gemv_us(tp: int, pdl: bool, early: bool) -> tuple[float, float]:
    """Gives (us per GEMV, GB/s)."""
    shapes = [(6144 // tp, 4096), (4096, 4096 // tp), (28672 // tp, 4096), (4096, 14336 // tp)]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n, k in shapes * 8]
    x0 = torch.randn(4 * 4096, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(w.shape[0], device="cuda", dtype=torch.bfloat16) for w in weights]

    def gemv(i: int) -> None:  # the i-th of the chain, reading the last one's output
        w, x = weights[i], x0 if i == 0 else outs[i - 1]
        _gemv[(w.shape[0] // 4,)](x, w, outs[i], w.shape[1], BLOCK_N=4, BLOCK_K=512, PDL=pdl,
                                  EARLY=early, num_warps=4, num_stages=3, launch_pdl=pdl)
    us = graph_time_us(gemv, calls=len(weights))
    mean_bytes = sum(w.numel() * 2 for w in weights) / len(weights)
    return us, mean_bytes / us / 1e3


def main() -> None:
    for tp in (1, 2):
        for pdl, early in ((False, False), (True, False), (True, True)):
            us, gbps = per_gemv_us(tp, pdl, early)
            print(f"TP={tp} pdl={pdl} early={early}: {us:.2f} us per GEMV ({gbps:.0f} GB/s)",
                  flush=True)


if __name__ == "__main__":
    main()
