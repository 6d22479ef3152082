"""One-shot all-reduce fused with the residual add and RMSNorm after it, over peer memory.

Under tensor parallelism a decoder layer's attention and MLP each end in a row-parallel
projection whose partial output the ranks sum (an all-reduce); the next norm then adds the
residual stream and normalises. At decode sizes that is two launches, and the all-reduce's is
the long one. Here one kernel does both, on a group whose GPUs read each other's memory
(torch symmetric memory gives every rank the addresses of its peers' buffers and signal pads):

1. each program copies its rows of this rank's partial sum into this rank's buffer;
2. it meets the same program on every peer (a barrier over the signal pads);
3. it sums each row over the ranks' buffers in rank order, in float32, rounded to the
   dtype as an all-reduce gives it, so every rank holds the same bits;
4. adds the residual and normalises, with the rounding of `kvpilot.kernels.rmsnorm`
   (`normed_row`): at two ranks the result equals all-reduce + `rms_norm` bit for bit;
5. meets its peers again, so no rank writes its buffer for the next call while a peer
   still reads this one.

The signal pads hold uint32 slots `[program, rank]` and follow the protocol of torch's own
symmetric-memory kernels: a sender flips its slot on the peer 0 -> 1 (release, system
scope), the receiver flips it back 1 -> 0 (acquire). So a pad is all zeros between calls, a
CUDA graph replays the kernel as captured, and torch's ops can share the pad.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit
from kvpilot.kernels.rmsnorm import normed_row, rms_norm_ref


@jit
def _meet_peers(pads, program, RANK: tl.constexpr, WORLD: tl.constexpr,
                SEND: tl.constexpr, WAIT: tl.constexpr):
    """Signals program `program` of every peer, then waits for each peer's signal; a scalar
    atomic runs once per program, so each slot flips once. SEND orders this program's
    writes before the signal (release), WAIT its reads after the peers' (acquire)."""
    tl.debug_barrier()  # every thread's stores before the release
    for peer in range(WORLD):
        if peer != RANK:
            slot = tl.load(pads + peer).to(tl.pointer_type(tl.int32)) + program * WORLD + RANK
            while tl.atomic_cas(slot, 0, 1, sem=SEND, scope="sys") != 0:
                pass
    own = tl.load(pads + RANK).to(tl.pointer_type(tl.int32)) + program * WORLD
    for peer in range(WORLD):
        if peer != RANK:
            while tl.atomic_cas(own + peer, 1, 0, sem=WAIT, scope="sys") != 1:
                pass
    tl.debug_barrier()  # no thread reads before the acquire


@jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, buffers, pads,
    n_rows, n_cols, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
):
    program = tl.program_id(0)
    step = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dtype = out_ptr.dtype.element_ty
    own = tl.load(buffers + RANK).to(tl.pointer_type(dtype))
    for row in range(program, n_rows, step):
        x = tl.load(x_ptr + row * n_cols + offs, mask=mask)
        tl.store(own + row * n_cols + offs, x, mask=mask)
    _meet_peers(pads, program, RANK, WORLD, "release", "acquire")
    for row in range(program, n_rows, step):
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for rank in range(WORLD):
            part = tl.load(buffers + rank).to(tl.pointer_type(dtype))
            total += tl.load(part + row * n_cols + offs, mask=mask, other=0.0,
                             volatile=True).to(tl.float32)
        r = tl.load(residual_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        # the sum rounded as the all-reduce gives it, then the residual stream's add
        h = (total.to(dtype).to(tl.float32) + r).to(dtype)
        tl.store(residual_out_ptr + row * n_cols + offs, h, mask=mask)
        tl.store(out_ptr + row * n_cols + offs,
                 normed_row(h.to(tl.float32), weight_ptr, offs, mask, n_cols, eps, dtype),
                 mask=mask)
    # the peers have read this rank's rows before any rank writes its buffer again
    _meet_peers(pads, program, RANK, WORLD, "release", "relaxed")


def all_reduce_add_rms_norm(
    x: torch.Tensor,  # [T, hidden], contiguous: this rank's partial sum
    residual: torch.Tensor,  # [T, hidden], contiguous
    weight: torch.Tensor,  # [hidden]
    eps: float,
    buffers: torch.Tensor,  # int64 [world]: each rank's buffer address, >= T * hidden elements
    pads: torch.Tensor,  # int64 [world]: each rank's signal pad address, all zeros
    rank: int,
    max_programs: int,  # at most the pad's slots / world
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives (norm(sum_ranks(x) + residual), sum_ranks(x) + residual); every rank of the group
    calls it with the same shapes, in the same order."""
    n_rows, n_cols = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x)
    if n_rows:
        _all_reduce_add_rms_norm_kernel[(min(n_rows, max_programs),)](
            x, residual, weight, out, residual_out, buffers, pads, n_rows, n_cols, eps,
            RANK=rank, WORLD=buffers.numel(), BLOCK=triton.next_power_of_2(n_cols),
            num_warps=4 if n_cols <= 2048 else 8,
        )
    return out, residual_out


def all_reduce_add_rms_norm_ref(
    parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives the same from every rank's partial sum, summed in rank order in float32."""
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    total = total.to(parts[0].dtype)
    out = rms_norm_ref(total, weight, eps, residual)
    assert isinstance(out, tuple)
    return out
