"""A tensor-parallel group's all-reduce over torch symmetric memory, and the start-up that
decides whether the group uses it (the rules: `parallel.all_reduce_choice`).

Start-up, on every rank of the world, right after `init_distributed` and before the model
is built: each rank checks what it can see (the flag, CUDA, world size, dtype, one host,
the torch ops, peer access to the group's GPUs); the ranks agree (the smallest answer
wins, over the gloo host group); they allocate one symmetric buffer per group
(`symm_mem.empty` + `rendezvous`, a collective); they run one all-reduce of known values
through each algorithm the group can take and agree that every rank got the exact sum.
Any "no" on any rank and the whole group stays on NCCL, with a log line saying why; a check
that has not finished after a minute stops the start (its kernel spins on the GPU waiting
for a peer, so NCCL could not run behind it), naming --disable-custom-all-reduce. Every
rank calls every agreement whatever it found, so a refusal never leaves a peer waiting
(one exception: a rank whose allocation fails before the rendezvous leaves its peers in
the rendezvous until the store's timeout, then they fall back too).

The allocation holds more than torch's buffer: 2 x world slots of up to FUSED_MAX_BYTES,
written through raw peer addresses by kvpilot's own kernel that sums a row-parallel
projection's output, adds the residual and normalises in one launch
(`kvpilot.kernels.all_reduce_rmsnorm`, called from the norm after the projection; its slots
start empty and are their own signals), so it never meets torch's ops on the same bytes.
It is checked at start-up beside the others and agreed on alone: a group whose fused check
fails keeps the two-launch path (torch's all-reduce, then the norm kernel).

Under CUDA graph capture the ops are captured like any kernel: the buffer's address and
its peers' are fixed at start-up, and each call's launch reads them from the handle.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
from torch.nn import functional as F

from kvpilot.engine.parallel.all_reduce_choice import (
    NCCL,
    ONE_SHOT,
    OPS,
    TWO_SHOT,
    buffer_bytes,
    choose,
    one_shot_below,
    why_not,
    why_not_here,
)
from kvpilot.engine.parallel.groups import TPGroup

if TYPE_CHECKING:
    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.contracts.rendezvous import Rendezvous
    from kvpilot.engine.parallel.config import ModelShape
    from kvpilot.engine.parallel.distributed import RankContext
    from kvpilot.kernels.all_reduce_rmsnorm import FusedSlots

logger = logging.getLogger("kvpilot.engine")
CHECK_BYTES = 8192  # the start-up check's one-shot message: one decode token of 4096 bf16
CHECK_TIMEOUT_S = 60.0  # a check all-reduce still running after this never ends
FUSED = "fused add-rmsnorm"  # the one-shot all-reduce fused with the norm after it
SENT = "sent by the projection"  # fused calls whose rows the projection's kernel sent
CHECK_EPS = 1e-5
FUSED_PROGRAMS = 64  # the fused kernel's most programs (each waits on its own rows' slots)
# by group size, the largest message the fused kernel takes (its slots' size). In a CUDA graph
# on H100s (bench/results/parallel-H100-2026-11-27-lamport-pdl/call1-lamport/) it beat NCCL +
# the norm kernel and torch's one-shot + the norm kernel at every size from 8 KiB to 1 MiB at
# 2 ranks (8 KiB: 5.0 us against 8.8 and 10.5; 1 MiB: 11.2 against 16.3 and 18.9), and to
# 512 KiB at 4 (8 KiB: 7.6 against 11.8 and 11.1; 512 KiB: 12.5 against 16.4 and 18.3; 1 MiB:
# 22.2 against NCCL's 20.1). 1 MiB: a 64-sequence decode step of a 70B (64 x 8192 bf16)
FUSED_MAX_BYTES = {2: 1024 * 1024, 4: 512 * 1024}
# the group sizes the fused kernel runs at (it is measured at 2 and 4 ranks; at 8 its
# world x message bytes of peer stores per rank are not)
FUSED_WORLD_SIZES = (2, 4)
# the group sizes where a projection's kernel sends its product into the slots itself
# (`linear_send`): GPU-tested at 2 ranks, where the one-row GEMV's send took TP=2 batch-1 from
# 1.58x to 1.60x TP=1's speed (Llama-3-8B shape, H100s; two calls, each ratio within one); at
# 4 it has run in the interpreter only
SEND_WORLD_SIZES = (2,)


class SymmMemOps(Protocol):
    """What the path needs from torch (a fake stands in for it in the CPU tests)."""

    def missing(self) -> list[str]: ...
    def group_ranks(self, tp: TPGroup) -> list[int]: ...
    def peer_access(self, device: int, peer: int) -> bool: ...
    def allocate(self, nbytes: int, device: torch.device, tp: TPGroup) -> torch.Tensor: ...
    def one_shot(self, staged: torch.Tensor, x: torch.Tensor, group_name: str) -> None: ...
    def two_shot(self, staged: torch.Tensor, x: torch.Tensor, group_name: str) -> None: ...
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, sent: bool = False) -> tuple[torch.Tensor, torch.Tensor]: ...
    def linear_send(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...
    def finished(self, timeout_s: float) -> bool: ...


class TorchSymmMem:
    """torch.distributed._symmetric_memory and torch.ops.symm_mem (CUDA backend, no multicast);
    one per tensor-parallel group. `allocate` gives torch's buffer and keeps the rest of the
    allocation for the fused kernel: [torch's | 2 x world fused slots]."""

    def __init__(self) -> None:
        # the fused kernel's view of the allocation (set by `allocate`)
        self.slots: FusedSlots | None = None

    def missing(self) -> list[str]:
        return [op for op in OPS if not hasattr(torch.ops.symm_mem, op)]

    def group_ranks(self, tp: TPGroup) -> list[int]:
        import torch.distributed as dist

        return dist.get_process_group_ranks(tp.process_group())

    def peer_access(self, device: int, peer: int) -> bool:
        return torch.cuda.can_device_access_peer(device, peer)

    def allocate(self, nbytes: int, device: torch.device, tp: TPGroup) -> torch.Tensor:
        import torch.distributed._symmetric_memory as symm_mem

        from kvpilot.kernels.all_reduce_rmsnorm import FusedSlots, empty_slots

        # the one- and two-shot kernels read peers' memory directly and need no multicast
        # object; keep the rendezvous from making one (the device rules keep multicast off)
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        # no fused slots for a group the kernel does not run at (FUSED_WORLD_SIZES)
        slot_bytes = fused_bytes(nbytes, tp.size) if tp.size in FUSED_WORLD_SIZES else 0
        buffer = symm_mem.empty(nbytes + 2 * tp.size * slot_bytes, dtype=torch.uint8,
                                device=device)
        handle = symm_mem.rendezvous(buffer, tp.process_group())
        empty_slots(buffer[nbytes:])
        offset = buffer.data_ptr() - handle.buffer_ptrs[handle.rank]  # the same on every rank
        self.slots = FusedSlots(
            torch.tensor([p + offset + nbytes for p in handle.buffer_ptrs], dtype=torch.int64,
                         device=device),
            slot_bytes, torch.zeros(FUSED_PROGRAMS, dtype=torch.int32, device=device),
            handle.rank)
        # the slots emptied on this GPU before the agreement after this returns, so no peer's
        # first kernel writes into slots still being emptied
        torch.cuda.synchronize(device)
        return buffer[:nbytes]

    def one_shot(self, staged: torch.Tensor, x: torch.Tensor, group_name: str) -> None:
        # copies x into the buffer, waits for the peers, sums every rank's buffer into x
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", group_name, x)

    def two_shot(self, staged: torch.Tensor, x: torch.Tensor, group_name: str) -> None:
        staged.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", group_name, x)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, sent: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        from kvpilot.kernels.all_reduce_rmsnorm import all_reduce_add_rms_norm

        assert self.slots is not None  # allocated
        return all_reduce_add_rms_norm(x, residual, weight, eps, self.slots, sent=sent)

    def linear_send(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        from kvpilot.kernels.w8a16_gemm import gemm_send, gemv_send

        assert self.slots is not None  # allocated
        send = gemv_send if x.shape[0] == 1 else gemm_send
        return send(x, weight, self.slots)

    def finished(self, timeout_s: float) -> bool:
        """Gives whether the work queued on the current stream ends within `timeout_s` (the
        kernels spin on their peers' signals with no timeout of their own)."""
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True


class SymmMemAllReduce:
    """A group's all-reduce of messages up to `capacity` bytes through its symmetric buffer."""

    def __init__(self, ops: SymmMemOps, buffer: torch.Tensor, group_name: str,
                 world_size: int) -> None:
        self.ops = ops
        self.buffer = buffer  # uint8, this rank's part of the symmetric allocation
        self.capacity = buffer.numel()
        self.group_name = group_name
        self.world_size = world_size
        self.fused = False  # whether the ranks agreed on the fused kernel (setup_symm_mem)
        self.fused_limit = fused_bytes(self.capacity, world_size)  # its largest message
        # calls made from Python (eager steps and graph captures; replays do not count)
        self.calls = {ONE_SHOT: 0, TWO_SHOT: 0, FUSED: 0, SENT: 0}
        self.sent: torch.Tensor | None = None  # rows in the slots that add_rms_norm sums next

    def choose(self, x: torch.Tensor) -> str:
        """Gives the algorithm `x` takes: ONE_SHOT, TWO_SHOT, or NCCL (not through here)."""
        return choose(x, self.world_size, self.capacity)

    def all_reduce(self, x: torch.Tensor, algorithm: str) -> torch.Tensor:
        """Gives `x` summed over the group, in place, by `algorithm` (ONE_SHOT or TWO_SHOT)."""
        staged = self.buffer[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        if algorithm == ONE_SHOT:
            self.ops.one_shot(staged, x, self.group_name)
        else:
            self.ops.two_shot(staged, x, self.group_name)
        self.calls[algorithm] += 1
        return x

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Gives (norm(sum(x) + residual), sum(x) + residual) from the fused kernel, or None
        where it does not take `x`: not agreed on, not contiguous [T, hidden] rows of a dtype
        the group sums with a residual of their shape, or more than `fused_limit` bytes. An
        `x` that `linear_send` gave is in the slots already: the kernel only waits and sums."""
        if self.sent is not None:  # whatever comes next must sum it, or the slots go stale
            if x is not self.sent or residual.shape != x.shape or not residual.is_contiguous():
                raise RuntimeError("rows sent into the fused all-reduce's slots must be the "
                                   "next fused call's x, with a residual of their shape")
            self.sent = None
            self.calls[SENT] += 1
            return self.ops.add_rms_norm(x, residual, weight, eps, sent=True)
        if not self.takes(x) or residual.shape != x.shape or not residual.is_contiguous():
            return None
        self.calls[FUSED] += 1
        return self.ops.add_rms_norm(x, residual, weight, eps)

    def takes(self, x: torch.Tensor) -> bool:
        """Gives whether the fused kernel sums `x` (its residual aside)."""
        return self.fused and x.dim() == 2 and self.choose(x) != NCCL \
            and x.numel() * x.element_size() <= self.fused_limit

    def linear_send(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """Gives x @ weight.T for 1 to `w8a16_gemm.MAX_M` rows x [M, K] through a kernel that also
        sends the product into the fused kernel's slots (the one-row GEMV, the few-row tiled
        GEMM), so the `add_rms_norm` call that comes next only waits and sums; None where
        that call would not take the product (it must then be the product's next fused
        call: rows sent and never summed would be read as the next call's)."""
        from kvpilot.kernels.w8a16_gemm import MAX_M

        rows = x.shape[0]
        out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device="meta")  # its layout
        if self.world_size not in SEND_WORLD_SIZES or self.sent is not None \
                or not 0 < rows <= MAX_M or not self.takes(out):
            return None
        self.sent = self.ops.linear_send(x, weight)
        return self.sent


@dataclass(frozen=True)
class AllReduceSettings:
    """What start-up needs from the flags and the model."""

    disabled: bool
    capacity: int  # bytes of the symmetric buffer: the largest message it takes
    dtype: torch.dtype

    @classmethod
    def of(cls, args: EngineArgs, model_config: ModelShape) -> AllReduceSettings:
        return cls(args.disable_custom_all_reduce,
                   buffer_bytes(args.custom_all_reduce_max_bytes, args.max_num_seqs,
                                model_config.hidden_size, model_config.dtype),
                   model_config.dtype)


def with_symm_mem(ctx: RankContext, args: EngineArgs, model_config: ModelShape,
                  rendezvous: Rendezvous) -> RankContext:
    """Gives `ctx` with its TP group's all-reduce over symmetric memory where every rank can
    use it (else `ctx` as it was: NCCL, or gloo on CPU); every rank of the world calls it."""
    tp = setup_symm_mem(ctx.tp, AllReduceSettings.of(args, model_config), ctx.device,
                        rendezvous.local_ranks, ctx.min_over_ranks, TorchSymmMem())
    return replace(ctx, tp=tp)


def setup_symm_mem(tp: TPGroup, settings: AllReduceSettings, device: torch.device,
                   local_ranks: range, agree: Callable[[int], int],
                   ops: SymmMemOps) -> TPGroup:
    """Gives `tp` with a SymmMemAllReduce when every rank agrees it works (see the module doc);
    `agree(v)` gives the smallest `v` over the ranks."""
    if tp.size == 1:
        return tp
    # the flags, the device and the model are every rank's: the first rank says those
    shared = why_not(disabled=settings.disabled, device_type=device.type, world_size=tp.size,
                     dtype=settings.dtype, rocm=torch.version.hip is not None)
    reason = shared or _host_reason(tp, device, local_ranks, ops)
    if not agree(int(reason is None)):
        return _stay_on_nccl(tp, device, reason, own=shared is None)
    comm: SymmMemAllReduce | None = None
    try:
        group_name = tp.process_group().group_name
        comm = SymmMemAllReduce(ops, ops.allocate(settings.capacity, device, tp),
                                group_name, tp.size)
    except Exception as exc:  # any failure here: NCCL, said below
        reason = f"symmetric buffer of {settings.capacity} bytes not set up: {exc}"
    if not agree(int(comm is not None)) or comm is None:
        return _stay_on_nccl(tp, device, reason, own=True)
    reason = _self_check(comm, tp.rank, settings.dtype)
    if not agree(int(reason is None)):
        return _stay_on_nccl(tp, device, reason, own=True)
    if tp.size in FUSED_WORLD_SIZES:
        own_reason = fused_reason = _fused_check(comm, tp.rank, settings.dtype)
    else:  # the group's rule, not this rank's finding
        own_reason = None
        fused_reason = f"it runs at {FUSED_WORLD_SIZES} ranks: slower than two launches at more"
    comm.fused = bool(agree(int(fused_reason is None)))
    comm.calls = dict.fromkeys(comm.calls, 0)  # the checks are not counted
    if own_reason is not None and not tp.is_first:  # the group's rule: rank 0 says it
        logger.warning("all-reduce: rank %d cannot fuse the norm: %s", tp.rank, own_reason)
    if tp.is_first:
        limit = one_shot_below(tp.size)
        shots = "one-shot" if limit is None or limit > settings.capacity else \
            f"one-shot below {limit} bytes, two-shot from there"
        fused = f"those up to {comm.fused_limit} bytes before a residual norm fused with it" \
            if comm.fused else f"none fused with the norm ({fused_reason or 'another rank'})"
        logger.info("all-reduce: torch symmetric memory (%s) for messages up to %d bytes "
                    "(a %d-rank group on one host, peer-to-peer, no multicast), %s; NCCL above "
                    "(--custom-all-reduce-max-bytes sets the limit, "
                    "--disable-custom-all-reduce turns it off)", shots, settings.capacity,
                    tp.size, fused)
    return replace(tp, symm_mem=comm)


def fused_bytes(capacity: int, world_size: int) -> int:
    """Gives the fused kernel's slot size for a buffer of `capacity` bytes in a group of
    `world_size` ranks (0 where it does not run)."""
    return min(capacity, FUSED_MAX_BYTES.get(world_size, 0))


def check_input(rank: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Gives rank `rank`'s start-up check message: small integers, exact in bfloat16 summed."""
    return (torch.arange(numel, device=device) % 7 + rank).to(dtype)


def _self_check(comm: SymmMemAllReduce, rank: int, dtype: torch.dtype) -> str | None:
    """Gives why this rank's check all-reduces went wrong (None: each gave the exact sum)."""
    device = comm.buffer.device
    sizes = {ONE_SHOT: min(CHECK_BYTES, comm.capacity)}
    limit = one_shot_below(comm.world_size)
    if limit is not None and limit <= comm.capacity:
        sizes[TWO_SHOT] = limit
    for algorithm, nbytes in sizes.items():
        numel = nbytes // dtype.itemsize
        x = check_input(rank, numel, dtype, device)
        want = torch.stack([check_input(r, numel, dtype, device)
                            for r in range(comm.world_size)]).sum(0)
        try:
            comm.all_reduce(x, algorithm)
        except Exception as exc:  # a failing op: NCCL (the caller says)
            return f"the {algorithm} check all-reduce of {nbytes} bytes failed: {exc}"
        _wait_for_check(comm, algorithm, nbytes, rank)
        try:
            right = torch.equal(x, want)
        except Exception as exc:  # an asynchronous error of the op
            return f"the {algorithm} check all-reduce of {nbytes} bytes failed: {exc}"
        if not right:
            return f"the {algorithm} check all-reduce of {nbytes} bytes gave a wrong sum"
    return None


def _fused_check(comm: SymmMemAllReduce, rank: int, dtype: torch.dtype) -> str | None:
    """Gives why the fused kernel went wrong on this rank's check (None: the exact sum plus
    the residual, and its norm to the dtype's rounding)."""
    cols = min(CHECK_BYTES, comm.capacity) // dtype.itemsize // 2
    device = comm.buffer.device
    x = check_input(rank, 2 * cols, dtype, device).view(2, cols)
    residual = check_input(comm.world_size, 2 * cols, dtype, device).view(2, cols)
    weight = torch.linspace(0.5, 1.5, cols, device=device).to(dtype)
    want = residual + torch.stack([check_input(r, 2 * cols, dtype, device)
                                   for r in range(comm.world_size)]).sum(0).view(2, cols)
    want_out = F.rms_norm(want.float(), (cols,), weight.float(), CHECK_EPS)
    try:  # the kernel itself: the message is within the fused limit
        got = comm.ops.add_rms_norm(x, residual, weight, CHECK_EPS)
    except Exception as exc:  # a failing kernel: the two-launch path (the caller says)
        return f"the fused check of {x.numel() * dtype.itemsize} bytes failed: {exc}"
    _wait_for_check(comm, FUSED, x.numel() * dtype.itemsize, rank)
    try:
        right = torch.equal(got[1], want) and torch.allclose(got[0].float(), want_out,
                                                             rtol=1e-2, atol=1e-2)
    except Exception as exc:  # an asynchronous error of the kernel
        return f"the fused check failed: {exc}"
    return None if right else "the fused check gave a wrong sum or norm"


def _wait_for_check(comm: SymmMemAllReduce, algorithm: str, nbytes: int, rank: int) -> None:
    """Stops the start when the check's kernel still spins after CHECK_TIMEOUT_S: nothing,
    NCCL included, could run behind it on this GPU."""
    if not comm.ops.finished(CHECK_TIMEOUT_S):
        raise RuntimeError(
            f"the {algorithm} symmetric-memory check all-reduce of {nbytes} bytes did not "
            f"finish in {CHECK_TIMEOUT_S:.0f} s on tensor-parallel rank {rank} (a peer "
            "stopped, or cannot reach this GPU's memory): start with "
            "--disable-custom-all-reduce")


def _host_reason(tp: TPGroup, device: torch.device, local_ranks: range,
                 ops: SymmMemOps) -> str | None:
    """Gives why this rank cannot use the path from what it sees of its host and its torch
    (None: nothing stops it)."""
    ranks = ops.group_ranks(tp)
    one_host = all(r in local_ranks for r in ranks)
    me = device.index if device.index is not None else torch.cuda.current_device()
    peers = [r - local_ranks.start for r in ranks] if one_host else []
    return why_not_here(one_host=one_host, missing_ops=ops.missing(),
                        no_peer_access=[p for p in peers if p != me and not ops.peer_access(me, p)])


def _stay_on_nccl(tp: TPGroup, device: torch.device, reason: str | None,
                  own: bool) -> TPGroup:
    """Gives `tp` unchanged, after saying why: the first rank says it for the group, another
    rank a reason of its `own` only (not one every rank shares, such as the flag)."""
    backend = "NCCL" if device.type == "cuda" else "gloo"
    if tp.is_first:
        logger.info("all-reduce: %s for every message (no symmetric memory: %s)", backend,
                    reason or "another rank cannot use it; its log says why")
    elif reason is not None and own:
        logger.warning("all-reduce: rank %d cannot use symmetric memory: %s", tp.rank, reason)
    return tp
