"""One-shot all-reduce fused with the residual add and RMSNorm after it, over peer memory.

Under tensor parallelism a decoder layer's attention and MLP each end in a row-parallel
projection whose partial output the ranks sum (an all-reduce); the next norm then adds the
residual stream and normalises. At decode sizes that is two launches, and the all-reduce's is
the long one. Here one kernel does both, on a group whose GPUs read each other's memory
(torch symmetric memory gives every rank the addresses of its peers' buffers):

1. each program writes its rows of this rank's partial sum into this rank's slot of every
   rank's buffer (peer memory over NVLink: stores go out without waiting for an answer);
2. it signals the same program on every peer and waits for theirs (one barrier);
3. it sums each row over its own buffer's slots in rank order, in float32, rounded to the
   dtype as an all-reduce gives it, so every rank holds the same bits;
4. adds the residual and normalises, with the rounding of `kvpilot.kernels.rmsnorm`
   (`normed_row`): at two ranks the result equals all-reduce + `rms_norm` bit for bit.

One barrier per call, not two: each program counts its calls (`epochs`, this rank's own
memory) and signals that count, so signals never need resetting; each buffer has two halves
of `world` slots and a program writes the half of its call's parity, so a peer still reading
the previous call's rows reads the other half. Why that is safe: row i is always program
i % programs' (the grid is min(rows, programs)), so the program that writes row i in a call
also wrote it in the last call that had row i, one count earlier (the other half); and a
program that starts a call has passed the last call's barrier with the same program of
every peer, which had read that call's rows before it signalled.
The signal slots `pads[rank][program * world + peer]` are int32 counts compared by signed
difference, so they may wrap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit
from kvpilot.kernels.rmsnorm import normed_row, rms_norm_ref


@jit
def _meet_peers(pads, program, epoch, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Signals `epoch` to program `program` of every peer (release: after this program's
    stores), then waits until each peer has signalled it (acquire: before its loads). A
    scalar atomic runs once per program."""
    tl.debug_barrier()  # every thread's stores before the release
    for peer in range(WORLD):
        if peer != RANK:
            pad = tl.load(pads + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(pad + program * WORLD + RANK, epoch, sem="release", scope="sys")
    own = tl.load(pads + RANK).to(tl.pointer_type(tl.int32)) + program * WORLD
    for peer in range(WORLD):
        if peer != RANK:
            # a peer may already be one call ahead: wait for at least `epoch`
            while tl.atomic_add(own + peer, 0, sem="acquire", scope="sys") - epoch < 0:
                pass
    tl.debug_barrier()  # no thread reads before the acquire


@jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, buffers, pads, epochs,
    n_rows, n_cols, slot_numel, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
):
    program = tl.program_id(0)
    step = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dtype = out_ptr.dtype.element_ty
    epoch = tl.load(epochs + program) + 1
    half = (epoch % 2).to(tl.int64) * WORLD * slot_numel
    for row in range(program, n_rows, step):
        x = tl.load(x_ptr + row * n_cols + offs, mask=mask)
        for rank in range(WORLD):  # this rank's slot in every rank's buffer
            slot = tl.load(buffers + rank).to(tl.pointer_type(dtype)) + half + RANK * slot_numel
            tl.store(slot + row * n_cols + offs, x, mask=mask)
    _meet_peers(pads, program, epoch, RANK, WORLD)
    own = tl.load(buffers + RANK).to(tl.pointer_type(dtype)) + half
    for row in range(program, n_rows, step):
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for rank in range(WORLD):
            total += tl.load(own + rank * slot_numel + row * n_cols + offs, mask=mask,
                             other=0.0, volatile=True).to(tl.float32)
        r = tl.load(residual_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        # the sum rounded as the all-reduce gives it, then the residual stream's add
        h = (total.to(dtype).to(tl.float32) + r).to(dtype)
        tl.store(residual_out_ptr + row * n_cols + offs, h, mask=mask)
        tl.store(out_ptr + row * n_cols + offs,
                 normed_row(h.to(tl.float32), weight_ptr, offs, mask, n_cols, eps, dtype),
                 mask=mask)
    tl.store(epochs + program, epoch)


def all_reduce_add_rms_norm(
    x: torch.Tensor,  # [T, hidden], contiguous: this rank's partial sum
    residual: torch.Tensor,  # [T, hidden], contiguous
    weight: torch.Tensor,  # [hidden]
    eps: float,
    buffers: torch.Tensor,  # int64 [world]: each rank's buffer: 2 x world slots
    slot_bytes: int,  # of each slot: at least T * hidden elements
    pads: torch.Tensor,  # int64 [world]: each rank's signal slots, [programs * world] int32
    epochs: torch.Tensor,  # int32 [programs], this rank's: calls per program so far
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives (norm(sum_ranks(x) + residual), sum_ranks(x) + residual); every rank of the group
    calls it with the same shapes, in the same order. The slots and counts start at zero."""
    n_rows, n_cols = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x)
    if n_rows:
        _all_reduce_add_rms_norm_kernel[(min(n_rows, epochs.numel()),)](
            x, residual, weight, out, residual_out, buffers, pads, epochs, n_rows, n_cols,
            slot_bytes // x.element_size(), eps,
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
