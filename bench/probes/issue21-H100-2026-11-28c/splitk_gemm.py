"""Split-K GEMM for a decode step's projections: out = x @ weight.T, x [M, K] and a 16-bit
weight [N, K], M up to MAX_M.

A decode step's projections are small GEMMs: Qwen3-0.6B's o projection at 128 rows is 4 MB
of weight and 0.5 GFLOP, 1.4 us at copy bandwidth, yet cuBLAS takes about 6 us. Its 1024
output columns make only a few output tiles, so few SMs stream the whole K each. This
kernel also splits K: program (n, m, s) computes its output tile over the s-th of SPLIT_K
slices of K, so every SM streams a short slice.

The slices' float32 partial tiles meet in a workspace. Each program stores its partial, then
increments its tile's arrival counter (release); the program that arrives last (acquire)
sums the SPLIT_K partials in slice order, so the result's bits do not depend on which
program came last, rounds to the output dtype, stores, and resets the counter for the next
launch. No program waits on another, so any number of programs may be resident.

The counters persist per device (`_counters`) and every launch leaves them zero, so one
buffer serves every launch and CUDA graph on the device, as long as launches on it are
serialised (one stream, as the engine's are). The workspace is a fresh allocation per call.

Tiles and the split are autotuned per (N, K, M rounded up to a power of two) from CONFIGS
during the engine's warm-up, before CUDA graphs capture; the interpreter runs the sizes a
test gives.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit
from kvpilot.kernels.pdl import pdl_args, wait_for_previous

MAX_M = 256  # rows beyond which cuBLAS's large tiles take over
COUNTERS = 1 << 16  # arrival counters a device keeps: output tiles of one launch, at most

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); BLOCK_M above the rows is
# pruned, as are splits past the K tiles
CONFIGS = [
    (bm, bn, bk, s, w, st)
    for bm in (16, 32, 64, 128)
    for bn, bk, s, w, st in (
        (32, 128, 1, 4, 4), (64, 128, 1, 4, 4), (128, 64, 1, 4, 4),
        (32, 128, 2, 4, 4), (64, 128, 2, 4, 4), (128, 64, 2, 8, 3),
        (32, 128, 4, 4, 4), (64, 128, 4, 4, 3), (128, 64, 4, 8, 3),
        (32, 64, 8, 4, 4), (64, 64, 8, 4, 4), (128, 64, 8, 4, 3),
    )
]


@jit(do_not_specialize=["M", "M_BUCKET"])
def _splitk_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, M_BUCKET,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = False,
):
    """M_BUCKET: M rounded up to a power of two, the autotuner's key (unread here)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    # this program's slice of K: whole BLOCK_K tiles, the last slice possibly shorter
    per_slice = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * per_slice
    k_hi = tl.minimum(k_lo + per_slice, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PREFETCH:  # the slice's weight into L2 while the kernel before still runs (PDL)
        rows_w = tl.minimum(offs_n, N - 1)
        lines = tl.arange(0, BLOCK_K // 64) * 64
        for k0 in range(k_lo, k_hi, BLOCK_K):
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                [w_ptr + rows_w[:, None] * stride_wn + tl.minimum(k0 + lines, K - 1)[None, :]],
                dtype=tl.int32, is_pure=False, pack=1)
    wait_for_previous(PDL)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + offs_k) < k_hi
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    mask = m_ok[:, None] & n_ok[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tile_offs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + tile_offs, acc, mask=mask)
        # every thread's partial is stored before one thread announces the program's arrival
        tl.debug_barrier()
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # slice order: the same bits whoever is last
                # .cg reads L2, where the other programs' partials are, past this SM's L1
                total += tl.load(part_ptr + s * M * N + tile_offs, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Keeps the configs whose BLOCK_M fits M's bucket and whose split leaves every slice a
    K tile."""
    bucket, k = named_args["M_BUCKET"], named_args["K"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, bucket)
            and c.kwargs["SPLIT_K"] <= triton.cdiv(k, c.kwargs["BLOCK_K"])]
    return kept or configs[:1]


_tuned = triton.autotune(  # pyright: ignore[reportArgumentType]
    [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": s},
                   num_warps=w, num_stages=st) for bm, bn, bk, s, w, st in CONFIGS],
    key=["N", "K", "M_BUCKET"], prune_configs_by={"early_config_prune": _prune},
)(_splitk_kernel)

# the split-K kernel runs a 16-bit decode projection of MAX_M rows or fewer unless
# KVPILOT_SPLITK_GEMM=0, which keeps the previous kernels (for side-by-side benchmarks)
USE_SPLITK = os.environ.get("KVPILOT_SPLITK_GEMM", "1") != "0"


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    """Gives the device's arrival counters, zero between launches."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def splitk_linear(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, ...] | None = None
                  ) -> torch.Tensor:
    """Gives x @ weight.T [M, N] for 1 to MAX_M dense rows x [M, K] and a dense 16-bit weight
    [N, K]. `config` (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) fixes the
    tiles (always in the interpreter, where the default is a small split); else they are
    autotuned on a GPU."""
    rows, k = x.shape
    n = weight.shape[0]
    assert 0 < rows <= MAX_M and weight.shape[1] == k, f"1 to {MAX_M} rows of {k} columns"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight rows must be dense"
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    bucket = max(16, triton.next_power_of_2(rows))
    tune = config is None and os.environ.get("TRITON_INTERPRET") != "1"
    splits = max(s for _, _, _, s, _, _ in CONFIGS) if tune else (config or (16, 32, 32, 2))[3]
    part = torch.empty(splits * rows * n if splits > 1 else 1, dtype=torch.float32,
                       device=x.device)
    args = (x, weight, out, part, _counters(x.device), rows, n, k, bucket, x.stride(0),
            weight.stride(0), out.stride(0))
    if tune:
        _tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(rows, meta["BLOCK_M"]),
                             meta["SPLIT_K"])](*args, **pdl_args(x))
        return out
    bm, bn, bk, s, *rest = config or (16, 32, 32, 2)
    grid = (triton.cdiv(n, bn), triton.cdiv(rows, bm), s)
    assert grid[0] * grid[1] <= COUNTERS, "too many output tiles for the arrival counters"
    launch = dict(num_warps=rest[0], num_stages=rest[1]) if rest else {}
    _splitk_kernel[grid](*args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, **launch,
                         **pdl_args(x))
    return out
