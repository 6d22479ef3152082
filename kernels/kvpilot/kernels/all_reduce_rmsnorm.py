"""One-shot all-reduce fused with the residual add and RMSNorm after it, over peer memory.

Under tensor parallelism a decoder layer's attention and MLP each end in a row-parallel
projection whose partial output the ranks sum (an all-reduce); the next norm then adds the
residual stream and normalises. At decode sizes that is two launches, and the all-reduce's is
the long one. Here one kernel does both, on a group whose GPUs read each other's memory
(torch symmetric memory gives every rank the addresses of its peers' buffers):

1. each program writes its rows of this rank's partial sum into this rank's slot of every
   rank's buffer (peer memory over NVLink: stores go out without waiting for an answer);
2. it reads each row of its own buffer's slots until every element has arrived, and sums
   them in rank order, in float32, rounded to the dtype as an all-reduce gives it, so every
   rank holds the same bits; then it marks those slots empty again;
3. adds the residual and normalises, with the rounding of `kvpilot.kernels.rmsnorm`
   (`normed_row`): at two ranks the result equals all-reduce + `rms_norm` bit for bit.

No flag, no fence (Lamport's scheme, as TensorRT-LLM's one-shot all-reduce): an empty slot
holds a bit pattern no message holds, EMPTY16 in every 16-bit half, so the data is its own
signal. A writer sends a bfloat16 -0.0 (0x8000) as +0.0 and a float32 with the bits
0x80008000 (a denormal, -4.6e-41) as -0.0; the reader spins on volatile loads of its own
memory until no element of the row reads empty (each element lands whole, so a row read
half-written is read again). The barrier-and-signal form this replaced waited for a
system-scope release after its stores: one NVLink round trip more per call.

Why one slot per rank per row is enough with two halves: each program counts its calls
(`epochs`, this rank's memory; every rank makes the same calls, so the counts agree) and uses
the half of its call's parity. Row i is always program i % programs' (the grid is
min(rows, programs)), so the rows a program reads are the rows it marks empty. A peer writes
into a half again two calls later, which it reaches only after reading this rank's writes of
the call between, made by a later launch than the one that emptied the half.

A kernel that computes the partial sum can send it itself (`send_first_row`, `send_rows`;
the one-row GEMV and the few-row GEMM do, `w8a16_gemm.gemv_send` and `gemm_send`): its stores
go out while its other programs still read weights, and the call after it runs with `sent`
and only waits, sums and normalises. A sender takes each row's half from the count of the
program that reads the row, as that program's own first phase would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit
from kvpilot.kernels.pdl import pdl_args, wait_for_previous
from kvpilot.kernels.rmsnorm import normed_row, rms_norm_ref

EMPTY16 = -0x8000  # an empty slot's every 16-bit half: 0x8000, a bfloat16 -0.0
# by element size: the integers a slot's element is read as, an empty element's bits, and
# what a message sends in their place (-0.0 as +0.0; the float32 0x80008000 as -0.0)
EMPTY_BITS = {2: (torch.int16, EMPTY16, 0),
              4: (torch.int32, -0x7FFF8000, -0x80000000)}
TL_BITS = {torch.int16: tl.int16, torch.int32: tl.int32}


def empty_slots(buffer: torch.Tensor) -> None:
    """Marks every slot of `buffer` (a rank's fused slots, any dtype) empty."""
    buffer.view(torch.int16).fill_(EMPTY16)


@jit
def send(bits, at, mask, buffers, half, slot_numel, EMPTY: tl.constexpr, SENT_AS: tl.constexpr,
         RANK: tl.constexpr, WORLD: tl.constexpr):
    """Stores `bits` (a partial sum's elements as integers of their width) at offsets `at` of
    this rank's slot in every rank's buffer, in the `half` of the call they are for."""
    bits = tl.where(bits == EMPTY, SENT_AS, bits).to(bits.dtype)
    for rank in range(WORLD):
        slot = tl.load(buffers + rank).to(tl.pointer_type(bits.dtype)) + half \
            + RANK * slot_numel
        tl.store(slot + at, bits, mask=mask)


@jit
def send_first_row(values, offs, mask, buffers, epochs, slot_numel, BITS: tl.constexpr,
                   EMPTY: tl.constexpr, SENT_AS: tl.constexpr, RANK: tl.constexpr,
                   WORLD: tl.constexpr):
    """Sends elements `offs` of a one-row partial sum (`values`, in its dtype) as the next
    call's first phase would; that call then runs with SENT (`all_reduce_add_rms_norm(...,
    sent=True)`). Called from the kernel that computes the row: its stores go out while
    it finishes, and the all-reduce kernel only waits and sums."""
    half = ((tl.load(epochs) + 1) % 2).to(tl.int64) * WORLD * slot_numel  # program 0's call
    send(values.to(BITS, bitcast=True), offs, mask, buffers, half, slot_numel, EMPTY, SENT_AS,
         RANK, WORLD)


@jit
def send_rows(values, offs_m, offs_n, mask, n_cols, buffers, epochs, programs, slot_numel,
              BITS: tl.constexpr, EMPTY: tl.constexpr, SENT_AS: tl.constexpr,
              RANK: tl.constexpr, WORLD: tl.constexpr):
    """Sends a tile of a partial sum [rows, n_cols] (`values` [len(offs_m), len(offs_n)] in its
    dtype) as the next call's first phase would, that call having `programs` programs (row i
    is program i % programs'); it then runs with SENT."""
    epoch = tl.load(epochs + offs_m % programs)  # padding rows too: masked off below
    half = ((epoch + 1) % 2).to(tl.int64) * WORLD * slot_numel
    send(values.to(BITS, bitcast=True), half[:, None] + offs_m[:, None] * n_cols
         + offs_n[None, :], mask, buffers, 0, slot_numel, EMPTY, SENT_AS, RANK, WORLD)


@jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, buffers, epochs,
    n_rows, n_cols, slot_numel, eps,
    EMPTY: tl.constexpr, SENT_AS: tl.constexpr, SENT: tl.constexpr,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """x_ptr: the partial sum as integers of its width; EMPTY: an empty slot element's bits,
    SENT_AS: what a message sends in their place; SENT: the rows are in the slots already
    (`send_first_row`)."""
    wait_for_previous(PDL)
    program = tl.program_id(0)
    step = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dtype = out_ptr.dtype.element_ty
    bits_ty = x_ptr.dtype.element_ty
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    epoch = tl.load(epochs + program) + 1
    half = (epoch % 2).to(tl.int64) * WORLD * slot_numel
    if not SENT:
        for row in range(program, n_rows, step):
            send(tl.load(x_ptr + row * n_cols + offs, mask=mask), row * n_cols + offs, mask,
                 buffers, half, slot_numel, EMPTY, SENT_AS, RANK, WORLD)
    own = tl.load(buffers + RANK).to(tl.pointer_type(bits_ty)) + half
    for row in range(program, n_rows, step):
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for rank in range(WORLD):
            at = own + rank * slot_numel + row * n_cols + offs
            part = tl.load(at, mask=mask, other=0, volatile=True)
            while (part == EMPTY).to(tl.int32).sum(0) > 0:  # not all there yet
                part = tl.load(at, mask=mask, other=0, volatile=True)
            total += part.to(dtype, bitcast=True).to(tl.float32)
        for rank in range(WORLD):  # empty again for the call after next
            tl.store(own + rank * slot_numel + row * n_cols + offs,
                     tl.full([BLOCK], EMPTY, bits_ty), mask=mask)
        r = tl.load(residual_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        # the sum rounded as the all-reduce gives it, then the residual stream's add
        h = (total.to(dtype).to(tl.float32) + r).to(dtype)
        tl.store(residual_out_ptr + row * n_cols + offs, h, mask=mask)
        tl.store(out_ptr + row * n_cols + offs,
                 normed_row(h.to(tl.float32), w, n_cols, eps, dtype),
                 mask=mask)
    tl.store(epochs + program, epoch)


@dataclass(frozen=True)
class FusedSlots:
    """A rank's view of the fused kernel's slots (kvpilot.engine.parallel.symm_mem_all_reduce
    holds it): what a kernel that sends rows into them (`send_first_row`, `send_rows`)
    needs."""

    buffers: torch.Tensor  # int64 [world]: each rank's buffer
    slot_bytes: int
    epochs: torch.Tensor  # int32 [programs]: this rank's calls per program
    rank: int

    def programs(self, rows: int) -> int:
        """Gives the fused kernel's programs for a message of `rows` rows."""
        return min(rows, self.epochs.numel())

    def send_args(self, dtype: torch.dtype) -> tuple[tuple, dict]:
        """Gives the arguments of `send_first_row` and `send_rows` for rows of `dtype`:
        (buffers, epochs, slot_numel) and the constants."""
        bits, empty, sent_as = EMPTY_BITS[dtype.itemsize]
        return ((self.buffers, self.epochs, self.slot_bytes // dtype.itemsize),
                dict(SEND=True, SEND_BITS=TL_BITS[bits], EMPTY=empty, SENT_AS=sent_as,
                     RANK=self.rank, WORLD=self.buffers.numel()))


def all_reduce_add_rms_norm(
    x: torch.Tensor,  # [T, hidden], contiguous: this rank's partial sum, 16 or 32 bits
    residual: torch.Tensor,  # [T, hidden], contiguous
    weight: torch.Tensor,  # [hidden]
    eps: float,
    slots: FusedSlots,  # this rank's view of the group's slots (each of T * hidden elements+)
    sent: bool = False,  # x is in the slots already (`send_first_row`, `send_rows`)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives (norm(sum_ranks(x) + residual), sum_ranks(x) + residual); every rank of the group
    calls it with the same shapes, in the same order. The slots start empty (`empty_slots`)
    and the counts at zero."""
    n_rows, n_cols = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x)
    if n_rows:
        bits, empty, sent_as = EMPTY_BITS[x.element_size()]
        _all_reduce_add_rms_norm_kernel[(slots.programs(n_rows),)](
            x.view(bits), residual, weight, out, residual_out, slots.buffers, slots.epochs,
            n_rows, n_cols, slots.slot_bytes // x.element_size(), eps, EMPTY=empty,
            SENT_AS=sent_as, SENT=sent, RANK=slots.rank, WORLD=slots.buffers.numel(),
            BLOCK=triton.next_power_of_2(n_cols),
            num_warps=4 if n_cols <= 2048 else 8, **pdl_args(x),
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
