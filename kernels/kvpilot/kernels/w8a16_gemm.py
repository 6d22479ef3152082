"""W8A16 GEMM for decode-sized batches: out = x @ (weight * scale[:, None]).T with an 8-bit
weight [N, K] (int8, or float8 E4M3 on GPUs that have it), a float32 per-row scale [N] and
activations x [M, K] (M <= MAX_M).

At decode sizes the layer is bound by reading the weight: the point of 8 bits is to read one
byte per weight, so the kernel widens each 8-bit tile to the activation dtype in registers
(the torch path writes and re-reads a widened copy of the whole weight). One program
computes BLOCK_N output columns for every row: `tl.dot` needs 16 rows, so the rows are
padded to BLOCK_M >= 16 with masks. A memory-bound kernel is as fast as the bytes it keeps in
flight, so the tile width along K and the pipeline depth matter most; on a GPU they are
autotuned per (N, K, BLOCK_M) from TUNED_CONFIGS during the engine's warm-up (before CUDA
graphs capture), and the interpreter runs the plain kernel with the sizes a test gives.
Larger batches are compute-bound and stay on the torch path.

One row (batch-1 decode, the latency case) has a kernel of its own, a GEMV: `tl.dot` would
pad the row to 16 and move every weight tile through shared memory into the MMA layout,
work a memory-bound kernel cannot hide when the weight is 8-bit. The GEMV multiplies each
widened tile by the row in registers, keeps a [BLOCK_N, BLOCK_K] float32 accumulator and
sums it once at the end; narrow BLOCK_N gives the [4096, K] layers enough programs to
keep every SM reading.

Both kernels also take a 16-bit weight (the model's dtype) without a scale: a bf16 model's
decode projections run on them (`decode_linear`: the GEMV for one row, the tiled kernel,
autotuned over SKINNY_CONFIGS, for 2 to MAX_M), and under tensor parallelism a row-parallel
projection's kernel can also send its product into the fused all-reduce's slots
(`gemv_send`, `gemm_send`; `kvpilot.kernels.all_reduce_rmsnorm`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvpilot.kernels.all_reduce_rmsnorm import FusedSlots, send_first_row, send_rows
from kvpilot.kernels.jit import Kernel, jit
from kvpilot.kernels.pdl import pdl_args, wait_for_previous

MAX_M = 64  # rows beyond which the torch path (widen, then cuBLAS) wins

# (BLOCK_N, BLOCK_K, num_warps, num_stages): from narrow, deep tiles (many programs, each
# streaming long rows) to wide ones; shared memory stays under Hopper's 228 KB at BLOCK_M 64
TUNED_CONFIGS = [
    (16, 256, 4, 3), (16, 512, 4, 4), (16, 1024, 4, 3), (32, 256, 4, 5),
    (32, 512, 4, 4), (64, 256, 4, 4), (16, 512, 8, 4), (32, 1024, 8, 3),
    (16, 256, 4, 6), (32, 256, 4, 6), (32, 128, 4, 8), (32, 512, 4, 5), (64, 128, 4, 6),
]

# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the same kernel with a 16-bit weight and 2 to
# MAX_M rows (`skinny_linear`): what its autotuner picked over a wider table at the TP=1, 2
# and 4 shards of Llama-3-8B's projections at 16 to 64 rows on an H100
# (bench/kernels/skinny_gemm_gpu.py)
SKINNY_CONFIGS = [
    (16, 128, 2, 6), (16, 128, 4, 6), (16, 256, 4, 4), (32, 128, 4, 4), (32, 128, 4, 6),
    (32, 256, 4, 3), (32, 256, 4, 4), (128, 128, 8, 3),
]

# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the one-row GEMV
GEMV_CONFIGS = [
    (2, 1024, 4, 3), (4, 512, 4, 3), (4, 1024, 4, 3), (4, 2048, 8, 3), (8, 512, 4, 3),
    (8, 1024, 8, 3), (8, 256, 4, 4), (16, 256, 4, 3), (16, 512, 8, 3), (2, 2048, 8, 2),
    (4, 1024, 8, 4), (8, 512, 4, 5),
]


@jit
def _w8a16_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, N, K, stride_wn,
    send_buffers, send_epochs, slot_numel,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr, PDL: tl.constexpr,
    SEND: tl.constexpr, SEND_BITS: tl.constexpr, EMPTY: tl.constexpr, SENT_AS: tl.constexpr,
    RANK: tl.constexpr, WORLD: tl.constexpr,
):
    """SEND: the row is a row-parallel projection's partial sum that the fused all-reduce +
    norm kernel sums next: also send it into every rank's slots (`send_first_row`)."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    # the first weight tile is loaded before waiting for the kernel that writes x (PDL)
    k_ok = offs_k < K
    w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    wait_for_previous(PDL)
    x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    acc = w.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_SCALE:
        out = out * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_n, out, mask=n_ok)
    if SEND:
        send_first_row(out, offs_n, n_ok, send_buffers, send_epochs, slot_numel, SEND_BITS,
                       EMPTY, SENT_AS, RANK, WORLD)


@jit
def _w8a16_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    send_buffers, send_epochs, slot_numel, send_programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr, PDL: tl.constexpr,
    SEND: tl.constexpr, SEND_BITS: tl.constexpr, EMPTY: tl.constexpr, SENT_AS: tl.constexpr,
    RANK: tl.constexpr, WORLD: tl.constexpr,
):
    """Without HAS_SCALE the weight is 16-bit (the model's dtype) and nothing scales the
    sums (`skinny_linear`). SEND: the rows are a row-parallel projection's partial sum that
    the fused all-reduce + norm kernel (of `send_programs` programs) sums next: also send
    them into every rank's slots (`send_rows`)."""
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    wait_for_previous(PDL)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    mask = m_ok[:, None] & n_ok[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)
    if SEND:
        send_rows(out, offs_m, offs_n, mask, N, send_buffers, send_epochs, send_programs,
                  slot_numel, SEND_BITS, EMPTY, SENT_AS, RANK, WORLD)


def _tuned(kernel: Kernel, table: list[tuple[int, int, int, int]], key: list[str]) -> Kernel:
    """Gives `kernel` autotuned over `table`'s (BLOCK_N, BLOCK_K, warps, stages) per `key`."""
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
               for n, k, w, s in table]
    return triton.autotune(configs, key=key)(kernel)  # pyright: ignore[reportReturnType, reportArgumentType]


_w8a16_tuned = _tuned(_w8a16_kernel, TUNED_CONFIGS, ["N", "K", "BLOCK_M"])
_skinny_tuned = _tuned(_w8a16_kernel, SKINNY_CONFIGS, ["N", "K", "BLOCK_M"])
_gemv_tuned = _tuned(_w8a16_gemv_kernel, GEMV_CONFIGS, ["N", "K"])
# the one-row GEMV (8-bit weights here, 16-bit ones in `one_row_linear`) is used unless
# KVPILOT_W8A16_GEMV=0 (for side-by-side benchmarks)
USE_GEMV = os.environ.get("KVPILOT_W8A16_GEMV", "1") != "0"
# the tiled kernel runs a 16-bit projection of 2 to MAX_M rows (`decode_linear`) unless
# KVPILOT_TILED_GEMM=0, which keeps cuBLAS (for side-by-side benchmarks)
USE_TILED = os.environ.get("KVPILOT_TILED_GEMM", "1") != "0"


def w8a16_gemm(
    x: torch.Tensor,  # [M, K], M <= MAX_M, rows dense
    weight: torch.Tensor,  # [N, K] int8 or float8_e4m3fn, rows dense
    scale: torch.Tensor,  # [N] float32
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Gives x @ (weight * scale[:, None]).T [M, N] in x's dtype; the tile sizes are autotuned
    on a GPU unless both `block_n` and `block_k` are given (always in the interpreter)."""
    rows = x.shape[0]
    n = weight.shape[0]
    assert rows <= MAX_M, f"{rows} rows: the torch path takes batches above {MAX_M}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight rows must be dense"
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    tune = (block_n is None or block_k is None) and os.environ.get("TRITON_INTERPRET") != "1"
    if rows == 1 and USE_GEMV:
        return _gemv_into(out, x, weight, scale, tune, block_n, block_k)
    return _gemm_into(out, x, weight, scale, tune, block_n, block_k)


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None,
         block_k: int | None = None) -> torch.Tensor:
    """Gives x @ weight.T [1, N] for one row x [1, K] and a 16-bit weight [N, K] (the model's
    dtype) through the one-row GEMV: a bf16 batch-1 decode's projections, where it reads the
    weight faster than cuBLAS's GEMM (bench/w8a16_gemv_gpu.py). The tile sizes are autotuned
    on a GPU unless both `block_n` and `block_k` are given (always in the interpreter)."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.stride(1) == 1 and weight.stride(1) == 1, \
        "one dense row and a dense weight"
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    tune = (block_n is None or block_k is None) and os.environ.get("TRITON_INTERPRET") != "1"
    return _gemv_into(out, x, weight, None, tune, block_n, block_k)


NO_SEND = dict(SEND=False, SEND_BITS=tl.int16, EMPTY=0, SENT_AS=0, RANK=0, WORLD=1)
# (N, K, dtypes) of the GEMV, (N, K, BLOCK_M, dtypes) of the tiled kernel -> its tuned config,
# for launches that send their rows (never timed: a timed launch would send into the peers'
# slots). The dtypes keep a bfloat16 pick's tiles from a float32 launch they do not fit.
_send_configs: dict[tuple, triton.Config] = {}


def _gemv_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
               scale: torch.Tensor | None, tune: bool, block_n: int | None,
               block_k: int | None, send: FusedSlots | None = None) -> torch.Tensor:
    """Launches the one-row GEMV into `out` [1, N] (autotuned, or with the given tiles);
    without a `scale` the weight is the model's dtype and nothing scales the sums; with
    `send` the row also goes into the fused all-reduce's slots."""
    n, k = weight.shape
    # without a scale (or send) its pointers are never read: the weight's stand in
    args = (x, weight, weight if scale is None else scale, out, n, k, weight.stride(0))
    sent, consts = send.send_args(out.dtype) if send is not None else ((weight, weight, 0),
                                                                         NO_SEND)
    consts = dict(consts, HAS_SCALE=scale is not None, **pdl_args(x))
    _launch(_w8a16_gemv_kernel, _gemv_tuned, n, (*args, *sent), consts, tune,
            (block_n or 4, block_k or 256),
            (n, k, x.dtype, weight.dtype) if send is not None else None,  # as tuned is keyed
            lambda: _gemv_into(torch.empty_like(out), x, weight, scale, tune, None, None))
    return out


def _gemm_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
               scale: torch.Tensor | None, tune: bool, block_n: int | None,
               block_k: int | None, send: FusedSlots | None = None) -> torch.Tensor:
    """Launches the tiled kernel into `out` [M, N] (autotuned over TUNED_CONFIGS with a
    `scale`, else SKINNY_CONFIGS; or with the given tiles); with `send` the rows also go
    into the fused all-reduce's slots."""
    rows, k = x.shape
    n = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(rows))
    args = (x, weight, weight if scale is None else scale, out, rows, n, k, x.stride(0),
            weight.stride(0), out.stride(0))
    if send is not None:
        (buffers, epochs, slot_numel), consts = send.send_args(out.dtype)
        sent = (buffers, epochs, slot_numel, send.programs(rows))
    else:
        sent, consts = (weight, weight, 0, 1), NO_SEND
    consts = dict(consts, BLOCK_M=block_m, HAS_SCALE=scale is not None, **pdl_args(x))
    _launch(_w8a16_kernel, _skinny_tuned if scale is None else _w8a16_tuned, n, (*args, *sent),
            consts, tune, (block_n or 16, block_k or 256),
            (n, k, block_m, x.dtype, weight.dtype) if send is not None else None,
            lambda: _gemm_into(torch.empty_like(out), x, weight, scale, tune, None, None))
    return out


def _launch(kernel: Kernel, tuned: Kernel, n: int, args: tuple, consts: dict, tune: bool,
            tiles: tuple[int, int], send_key: tuple | None,
            tune_plain: Callable[[], object]) -> None:
    """Launches `kernel` (one program per BLOCK_N of the N columns): through its autotuner
    `tuned` when `tune`, else with `tiles` (BLOCK_N, BLOCK_K). A launch that sends (a
    `send_key`) is never timed, as a timed launch would send into the peers' slots: it takes
    the tiles `tuned` picked for the plain launch of the same key, which `tune_plain` runs
    once."""
    if send_key is not None and tune:
        if send_key not in _send_configs:
            tune_plain()
            _send_configs[send_key] = tuned.best_config  # pyright: ignore[reportAttributeAccessIssue]  (the Autotuner's last pick)
        config = _send_configs[send_key]
        kernel[(triton.cdiv(n, config.kwargs["BLOCK_N"]),)](
            *args, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages,
            **consts)
    elif tune:
        tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **consts)
    else:
        kernel[(triton.cdiv(n, tiles[0]),)](*args, BLOCK_N=tiles[0], BLOCK_K=tiles[1],
                                            num_warps=4, **consts)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None,
                  block_k: int | None = None, send: FusedSlots | None = None) -> torch.Tensor:
    """Gives x @ weight.T [M, N] for 2 to MAX_M rows x [M, K] and a 16-bit weight [N, K] (the
    model's dtype) through the tiled kernel; with `send`, see `gemm_send`. The tile sizes are
    autotuned on a GPU unless both `block_n` and `block_k` are given (always in the
    interpreter)."""
    rows, k = x.shape
    n = weight.shape[0]
    assert 1 < rows <= MAX_M and weight.shape[1] == k, f"2 to {MAX_M} rows of {k} columns"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight rows must be dense"
    assert send is None or rows * n * x.element_size() <= send.slot_bytes, \
        "the rows must fit the fused slots"
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    tune = (block_n is None or block_k is None) and os.environ.get("TRITON_INTERPRET") != "1"
    return _gemm_into(out, x, weight, None, tune, block_n, block_k, send)


def gemm_send(x: torch.Tensor, weight: torch.Tensor, slots: FusedSlots,
              block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """Gives `skinny_linear(x, weight)` having also sent the rows into `slots` for the fused
    all-reduce + norm call that comes next on this rank (`all_reduce_add_rms_norm(...,
    sent=True)`). Tiles as `skinny_linear`'s (the send itself is never timed)."""
    return skinny_linear(x, weight, block_n, block_k, send=slots)


def gemv_send(x: torch.Tensor, weight: torch.Tensor, slots: FusedSlots) -> torch.Tensor:
    """Gives `gemv(x, weight)` having also sent the row into `slots` for the fused all-reduce
    + norm call that comes next on this rank (`all_reduce_add_rms_norm(..., sent=True)`)."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.stride(1) == 1 and weight.stride(1) == 1, \
        "one dense row and a dense weight"
    assert n * x.element_size() <= slots.slot_bytes, "the row must fit the fused slots"
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    return _gemv_into(out, x, weight, None, os.environ.get("TRITON_INTERPRET") != "1", None,
                      None, slots)


def takes_16_bit(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Gives whether a kernel here computes x @ weight.T for a 16-bit weight: dense [M, K]
    CUDA rows and a dense weight of x's dtype (bfloat16 or float16), one row through the
    GEMV (unless KVPILOT_W8A16_GEMV=0), 2 to MAX_M through the tiled kernel (unless
    KVPILOT_TILED_GEMM=0)."""
    rows = x.shape[0]
    return ((USE_GEMV and rows == 1) or (USE_TILED and 1 < rows <= MAX_M)) and x.is_cuda \
        and x.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1 \
        and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype


def one_row_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose one-row CUDA case with a 16-bit weight goes through `gemv` (unless
    KVPILOT_W8A16_GEMV=0); every other case is F.linear itself."""
    if x.shape[0] == 1 and takes_16_bit(x, weight):
        out = gemv(x, weight)
        return out if bias is None else out + bias
    return torch.nn.functional.linear(x, weight, bias)


def decode_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`one_row_linear`, whose CUDA case of 2 to MAX_M rows with a 16-bit weight goes through
    the tiled kernel (`skinny_linear`, unless KVPILOT_TILED_GEMM=0): a decode step's
    projections. At batch 64 it gave the Llama-3-8B shape 3.4% more throughput than cuBLAS on
    one H100 (bench/tiled_tp1_gpu.py)."""
    if x.shape[0] > 1 and takes_16_bit(x, weight):
        out = skinny_linear(x, weight)
        return out if bias is None else out + bias
    return one_row_linear(x, weight, bias)


def w8a16_gemm_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Gives the same product computed in float32 with torch."""
    return ((x.float() @ weight.float().t()) * scale[None, :]).to(x.dtype)
