"""The fused all-reduce + residual add + RMSNorm kernel, run by real rank processes.

On CPU each rank is a process running the kernel in Triton's interpreter; the ranks' buffers
are files every process maps shared, so a rank's kernel writes into its peers' memory and
spins on its own until their rows arrive, as on GPUs (where tests/parallel's GPU tests run it
over torch symmetric memory). What this does not prove: the GPU memory model (volatile loads
seeing peers' stores over NVLink element by element), which only the GPU tests exercise.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kernel_testing import DEVICE, DTYPES

from kvpilot.kernels.all_reduce_rmsnorm import (
    EMPTY16,
    FusedSlots,
    all_reduce_add_rms_norm,
    all_reduce_add_rms_norm_ref,
    empty_slots,
)
from kvpilot.kernels.rmsnorm import rms_norm
from kvpilot.kernels.w8a16_gemm import gemm_send, gemv, gemv_send, skinny_linear

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the GPU form runs in "
                                "tests/parallel/test_symm_mem_all_reduce_gpu.py")

HIDDEN, EPS = 48, 1e-6
ROWS = (1, 5, 3, 4, 1, 2)  # calls in a row, some with more rows than programs
PROGRAMS = 2
# what every rank process imports, loaded once by the forkserver the ranks fork from
RANK_IMPORTS = ["torch", "triton", "kvpilot.kernels.all_reduce_rmsnorm",
                "kvpilot.kernels.w8a16_gemm", __name__]  # this module: the ranks' targets


def inputs(rank: int, rows: int, call: int, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gives rank `rank`'s partial sum, and the residual and weight every rank shares. Its
    first row holds -0.0 (an empty slot's bits at 16 bits) and, in float32, the one value a
    message sends as another (bits 0x80008000): a kernel that waits for them never ends."""
    gen = torch.Generator().manual_seed(1000 * call + rows)
    residual, weight = torch.randn(rows, HIDDEN, generator=gen), torch.randn(HIDDEN, generator=gen)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rank * 7 + call))
    x = x.to(dtype)
    x[0, :3] = -0.0
    if dtype == torch.float32:
        x[0, 3:5].view(torch.int32).fill_(-0x7FFF8000)
    return x, residual.to(dtype), weight.to(dtype)


def shared(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)


def mapped_slots(rank: int, world: int, dtype: torch.dtype, root: Path
                 ) -> tuple[FusedSlots, list[torch.Tensor]]:
    """Gives rank `rank`'s view of every rank's buffer file, and the mapped buffers."""
    slot = max(ROWS) * HIDDEN
    buffers = [shared(root / f"buffer{r}", 2 * world * slot, dtype) for r in range(world)]
    return FusedSlots(torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64),
                      slot * dtype.itemsize, torch.zeros(PROGRAMS, dtype=torch.int32),
                      rank), buffers


def rank_main(rank: int, world: int, dtype: torch.dtype, root: Path) -> None:
    """Maps every rank's buffer, runs the calls of ROWS, saves what it got."""
    slots, _buffers = mapped_slots(rank, world, dtype, root)  # the maps live to the end
    got = []
    for call, rows in enumerate(ROWS):
        x, residual, weight = inputs(rank, rows, call, dtype)
        got.append(all_reduce_add_rms_norm(x, residual, weight, EPS, slots))
    torch.save((got, slots.epochs), root / f"got{rank}.pt")


def run_ranks(target: Callable[[int, int, torch.dtype, Path], None], world: int,
              dtype: torch.dtype, root: Path) -> int:
    """Runs `target` as `world` rank processes over empty buffer files in `root`; gives the
    buffers' element count."""
    numel = 2 * world * max(ROWS) * HIDDEN
    for r in range(world):  # the files exist, empty, before any rank maps them
        empty_slots(shared(root / f"buffer{r}", numel, dtype))
    # Fresh processes, forked from a server that imported torch, Triton and the kernels once
    # (a spawned rank re-imports them: ~2.5 s of a test's CPU per rank on a 2-core box)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_IMPORTS)
    procs = [ctx.Process(target=target, args=(r, world, dtype, root), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0, f"a rank process ended with {p.exitcode}"
    return numel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_get_the_all_reduced_norm_bit_for_bit(tmp_path: Path, world: int,
                                                    dtype: torch.dtype):
    numel = run_ranks(rank_main, world, dtype, tmp_path)
    saved = [torch.load(tmp_path / f"got{r}.pt") for r in range(world)]
    got = [outputs for outputs, _ in saved]
    for call, rows in enumerate(ROWS):
        parts = [inputs(r, rows, call, dtype)[0] for r in range(world)]
        _, residual, weight = inputs(0, rows, call, dtype)
        want_out, want_residual = all_reduce_add_rms_norm_ref(parts, residual, weight, EPS)
        # the two-launch path (sum, then the rmsnorm kernel) on the same rank-order sum
        total = all_reduce_add_rms_norm_ref(parts, torch.zeros_like(residual), weight, EPS)[1]
        two_launch = rms_norm(total, weight, EPS, residual)
        for r in range(world):
            out, residual_out = got[r][call]
            assert torch.equal(residual_out, want_residual), (r, call)
            assert torch.equal(residual_out, two_launch[1])
            assert torch.equal(out, two_launch[0]), (r, call)
            torch.testing.assert_close(out, want_out)
    # each program counted its calls, and left every slot it read empty again
    want_epochs = torch.tensor([sum(rows > p for rows in ROWS) for p in range(PROGRAMS)],
                               dtype=torch.int32)
    for r in range(world):
        assert torch.equal(saved[r][1], want_epochs)
        buffer = shared(tmp_path / f"buffer{r}", numel, dtype).view(torch.int16)
        assert bool((buffer == EMPTY16).all()), r


# calls of the second test: (rows, whether the projection sends its rows: the GEMV one, the
# tiled kernel more); sent and plain calls interleave, so both use the halves in turn, and
# rows beyond the fused kernel's programs share a program's count. Before calls 2 and 8 the
# programs' counts differ in parity: a sender must take each row's half from its program
SENT_CALLS = ((1, True), (3, True), (1, False), (5, True), (2, True), (1, True), (3, False),
              (2, True), (1, True))
K_IN = 40
TILES = dict(block_n=16, block_k=64)  # the tiled kernel's in the interpreter


def sent_product(a: torch.Tensor, w: torch.Tensor, slots: FusedSlots) -> torch.Tensor:
    """Gives a @ w.T having sent it into `slots`: the GEMV for one row, else the tiled kernel."""
    return gemv_send(a, w, slots) if a.shape[0] == 1 else gemm_send(a, w, slots, **TILES)


def projection(rank: int, call: int, rows: int, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives rank `rank`'s GEMV input [rows, K_IN] and weight [HIDDEN, K_IN] of a call."""
    gen = torch.Generator().manual_seed(100 * rank + call)
    return (torch.randn(rows, K_IN, generator=gen).to(dtype),
            (torch.randn(HIDDEN, K_IN, generator=gen) / 4).to(dtype))


def sent_rank_main(rank: int, world: int, dtype: torch.dtype, root: Path) -> None:
    """Runs SENT_CALLS: a sending call's partial sum comes from `sent_product`."""
    slots, _buffers = mapped_slots(rank, world, dtype, root)  # the maps live to the end
    got = []
    for call, (rows, sent) in enumerate(SENT_CALLS):
        a, w = projection(rank, call, rows, dtype)
        x = sent_product(a, w, slots) if sent else a @ w.T
        _, residual, weight = inputs(rank, rows, call, dtype)
        got.append(all_reduce_add_rms_norm(x, residual, weight, EPS, slots, sent=sent))
    torch.save(got, root / f"got{rank}.pt")


@pytest.mark.parametrize(("world", "dtype"), [(2, DTYPES[0]), (2, DTYPES[1]), (4, DTYPES[0])])
def test_rows_a_projection_sent_are_summed_as_ones_the_kernel_sent(tmp_path: Path, world: int,
                                                                   dtype: torch.dtype):
    numel = run_ranks(sent_rank_main, world, dtype, tmp_path)
    got = [torch.load(tmp_path / f"got{r}.pt") for r in range(world)]
    for call, (rows, sent) in enumerate(SENT_CALLS):
        parts = []
        for r in range(world):
            a, w = projection(r, call, rows, dtype)
            if not sent:
                parts.append(a @ w.T)
            else:
                parts.append(gemv(a, w, block_n=4, block_k=256) if rows == 1
                             else skinny_linear(a, w, **TILES))
        _, residual, weight = inputs(0, rows, call, dtype)
        want_out, want_residual = all_reduce_add_rms_norm_ref(parts, residual, weight, EPS)
        total = all_reduce_add_rms_norm_ref(parts, torch.zeros_like(residual), weight, EPS)[1]
        two_launch = rms_norm(total, weight, EPS, residual)
        for r in range(world):
            assert torch.equal(got[r][call][1], want_residual), (r, call)
            assert torch.equal(got[r][call][0], two_launch[0]), (r, call)
            torch.testing.assert_close(got[r][call][0], want_out)
    for r in range(world):
        buffer = shared(tmp_path / f"buffer{r}", numel, dtype).view(torch.int16)
        assert bool((buffer == EMPTY16).all()), r
