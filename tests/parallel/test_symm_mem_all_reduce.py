"""The choice between the symmetric-memory all-reduce and NCCL, on CPU with fakes: which
algorithm a tensor takes (size, world size, dtype, layout), the buffer's size, why a rank
cannot use the path, the start-up agreement and check (every refusal said in the log, any
rank's "no" keeps the whole group on NCCL), and TPGroup sending each tensor its way."""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from kvpilot.engine.contracts.args import EngineArgs, add_dataclass_args, from_namespace
from kvpilot.engine.parallel import groups
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
from kvpilot.engine.parallel.symm_mem_all_reduce import (
    FUSED,
    FUSED_MAX_BYTES,
    SENT,
    AllReduceSettings,
    SymmMemAllReduce,
    check_input,
    setup_symm_mem,
)

BF16, FP32 = torch.bfloat16, torch.float32
KIB = 1024


def rows(n: int, hidden: int = 4096, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.zeros(n, hidden, dtype=dtype)


@pytest.mark.parametrize(("x", "world", "capacity", "want"), [
    (rows(1), 2, 512 * KIB, ONE_SHOT),  # a batch-1 decode step: 8 KiB
    (rows(64), 2, 512 * KIB, ONE_SHOT),  # exactly the buffer
    (rows(65), 2, 512 * KIB, NCCL),  # one row more than the buffer
    (rows(64), 2, 4096 * KIB, ONE_SHOT),  # 2 ranks: one-shot at every size
    (rows(63), 4, 4096 * KIB, ONE_SHOT),  # 4 ranks: one-shot below 512 KiB
    (rows(64), 4, 4096 * KIB, TWO_SHOT),  # 512 KiB
    (rows(31), 8, 4096 * KIB, ONE_SHOT),  # 8 ranks: one-shot below 256 KiB
    (rows(32), 8, 4096 * KIB, TWO_SHOT),
    (rows(1, dtype=FP32), 2, 512 * KIB, ONE_SHOT),
    (rows(1, dtype=torch.float16), 2, 512 * KIB, NCCL),  # torch's kernels: bf16 and fp32
    (torch.zeros(7, dtype=BF16), 2, 512 * KIB, NCCL),  # 14 bytes: not 16-byte sized
    (rows(8, 64, FP32).t(), 2, 512 * KIB, NCCL),  # not contiguous
    (rows(9, 8, FP32)[1:], 2, 512 * KIB, ONE_SHOT),  # 32-byte offset
    (torch.zeros(18, dtype=FP32)[2:], 2, 512 * KIB, NCCL),  # 8-byte offset
    (rows(0), 2, 512 * KIB, NCCL),  # nothing to reduce
])
def test_choose(x: torch.Tensor, world: int, capacity: int, want: str):
    assert choose(x, world, capacity) == want


@pytest.mark.parametrize(("max_bytes", "seqs", "hidden", "dtype", "want"), [
    (0, 64, 4096, BF16, 512 * KIB),  # one decode step of a Llama-3-8B at 64 sequences
    (0, 256, 8192, BF16, 4096 * KIB),  # a 70B at the default max_num_seqs
    (0, 1024, 8192, BF16, 8192 * KIB),  # 16 MiB capped at vLLM's custom all-reduce's 8 MiB
    (16 << 20, 64, 4096, BF16, 16 << 20),  # the flag is not capped
    (0, 3, 5, FP32, 64),  # 60 bytes, rounded up to 16
    (1000, 64, 4096, BF16, 1008),  # the flag wins, rounded up
])
def test_buffer_bytes(max_bytes, seqs, hidden, dtype, want):
    assert buffer_bytes(max_bytes, seqs, hidden, dtype) == want


def test_one_shot_below():
    assert [one_shot_below(w) for w in (2, 4, 8)] == [None, 512 * KIB, 256 * KIB]
    with pytest.raises(ValueError, match="world_size=16"):
        one_shot_below(16)


@pytest.mark.parametrize(("kwargs", "want"), [
    ({}, None),
    ({"disabled": True}, "--disable-custom-all-reduce is set"),
    ({"device_type": "cpu"}, "device cpu: symmetric memory needs CUDA GPUs"),
    ({"rocm": True}, "ROCm: the symmetric-memory all-reduce is built and checked for NVIDIA "
                     "GPUs only"),
    ({"world_size": 3}, "tensor_parallel_size=3: torch's kernels take (2, 4, 8) ranks"),
    ({"dtype": torch.float16}, "dtype float16: torch's kernels take bfloat16 and float32"),
])
def test_why_not(kwargs, want):
    base = dict(disabled=False, device_type="cuda", world_size=2, dtype=BF16)
    assert why_not(**{**base, **kwargs}) == want


@pytest.mark.parametrize(("kwargs", "want"), [
    ({}, None),
    ({"one_host": False}, "spans nodes"),
    ({"missing_ops": ["two_shot_all_reduce_out"]}, "lacks torch.ops.symm_mem.two_shot_all_"),
    ({"no_peer_access": [1]}, "no peer-to-peer access to GPU(s) [1]"),
])
def test_why_not_here(kwargs, want):
    got = why_not_here(**{**dict(one_host=True, missing_ops=[], no_peer_access=[]), **kwargs})
    assert got == want if want is None else want in got


class FakeOps:
    """torch's symmetric memory for rank `rank` of `world`: its peers hold the start-up
    check's messages, so a right all-reduce adds theirs; `fault` breaks one part."""

    def __init__(self, rank: int = 0, world: int = 2, fault: str | None = None,
                 ranks: list[int] | None = None) -> None:
        self.rank, self.world, self.fault = rank, world, fault
        self.ranks = ranks if ranks is not None else list(range(world))
        self.ran: list[str] = []

    def missing(self) -> list[str]:
        return [OPS[0]] if self.fault == "missing" else []

    def group_ranks(self, tp: TPGroup) -> list[int]:
        return self.ranks

    def peer_access(self, device: int, peer: int) -> bool:
        return self.fault != "no-p2p"

    def allocate(self, nbytes: int, device: torch.device, tp: TPGroup) -> torch.Tensor:
        if self.fault == "alloc":
            raise RuntimeError("boom")
        return torch.zeros(nbytes, dtype=torch.uint8)

    def _reduce(self, name: str, staged: torch.Tensor, x: torch.Tensor) -> None:
        assert staged.shape == x.shape and staged.dtype == x.dtype
        self.ran.append(name)
        if self.fault == "raise":
            raise RuntimeError("kernel failed")
        if self.fault != "wrong":
            for r in range(self.world):
                if r != self.rank:
                    x.add_(check_input(r, x.numel(), x.dtype, x.device).view(x.shape))

    def one_shot(self, staged: torch.Tensor, x: torch.Tensor, group_name: str) -> None:
        self._reduce(ONE_SHOT, staged, x)

    def two_shot(self, staged: torch.Tensor, x: torch.Tensor, group_name: str) -> None:
        self._reduce(TWO_SHOT, staged, x)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, sent: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        self.ran.append(SENT if sent else FUSED)
        if self.fault == "fused-raise":
            raise RuntimeError("fused kernel failed")
        total = x.clone()
        for r in range(self.world):
            if r != self.rank:
                total += check_input(r, x.numel(), x.dtype, x.device).view(x.shape)
        h = total + residual + (self.fault == "fused-wrong")
        return F.rms_norm(h, (x.shape[-1],), weight, eps), h

    def linear_send(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.ran.append("linear_send")
        return x @ weight.T

    def finished(self, timeout_s: float) -> bool:
        return self.fault != "hang"


class Agree:
    """The host-group agreement: the smallest of this rank's value and the others' answers."""

    def __init__(self, others: list[int] | None = None) -> None:
        self.others = others or []
        self.values: list[int] = []

    def __call__(self, value: int) -> int:
        self.values.append(value)
        other = self.others[len(self.values) - 1] if len(self.values) <= len(self.others) else 1
        return min(value, other)


GROUP = SimpleNamespace(group_name="tp")
CUDA0 = torch.device("cuda", 0)


def setup(ops: FakeOps, agree: Agree, *, rank: int = 0, world: int = 2,
          disabled: bool = False, capacity: int = 512 * KIB, device: torch.device = CUDA0,
          local_ranks: range = range(0, 8)) -> TPGroup:
    tp = TPGroup(rank, world, group=GROUP)  # type: ignore[arg-type]
    return setup_symm_mem(tp, AllReduceSettings(disabled, capacity, BF16), device, local_ranks,
                          agree, ops)


def test_setup_uses_symmetric_memory_when_every_rank_can(caplog):
    ops, agree = FakeOps(), Agree()
    with caplog.at_level(logging.INFO, "kvpilot.engine"):
        tp = setup(ops, agree)
    assert tp.symm_mem is not None and tp.symm_mem.capacity == 512 * KIB
    assert agree.values == [1, 1, 1, 1] and ops.ran == [ONE_SHOT, FUSED]  # each check once
    assert tp.symm_mem.fused
    assert tp.symm_mem.calls == {ONE_SHOT: 0, TWO_SHOT: 0, FUSED: 0, SENT: 0}  # checks not counted
    assert "torch symmetric memory (one-shot) for messages up to 524288 bytes (a 2-rank " \
           "group on one host, peer-to-peer, no multicast), those up to 524288 bytes before " \
           "a residual norm fused with it" in caplog.text


@pytest.mark.parametrize(("fault", "others", "reason"), [
    ("fused-wrong", [], "the fused check gave a wrong sum or norm"),
    ("fused-raise", [], "the fused check of 8192 bytes failed: fused kernel failed"),
    (None, [1, 1, 1, 0], "another rank"),
])
def test_a_failed_fused_check_keeps_the_unfused_path(caplog, fault, others, reason):
    agree = Agree(others)
    with caplog.at_level(logging.INFO, "kvpilot.engine"):
        tp = setup(FakeOps(fault=fault), agree)
    assert tp.symm_mem is not None and not tp.symm_mem.fused  # one-shot stays
    assert agree.values == [1, 1, 1, int(fault is None)]
    assert f"none fused with the norm ({reason})" in caplog.text
    x = torch.zeros(1, 64, dtype=BF16)
    assert tp.all_reduce_add_rms_norm(x, x, torch.ones(64, dtype=BF16), 1e-6) is None


def test_setup_checks_two_shot_where_the_group_takes_it(caplog):
    ops = FakeOps(world=8)
    with caplog.at_level(logging.INFO, "kvpilot.engine"):
        tp = setup(ops, Agree(), world=8, capacity=1024 * KIB)
    assert tp.symm_mem is not None and ops.ran == [ONE_SHOT, TWO_SHOT]  # no fused check
    assert not tp.symm_mem.fused and "none fused with the norm (it runs at (2, 4) ranks" \
        in caplog.text
    assert "one-shot below 262144 bytes, two-shot from there" in caplog.text


@pytest.mark.parametrize(("fault", "kwargs", "agreed", "reason"), [
    (None, {"disabled": True}, [0], "--disable-custom-all-reduce is set"),
    (None, {"device": torch.device("cpu")}, [0], "gloo for every message (no symmetric "
                                                 "memory: device cpu"),
    (None, {"world": 3}, [0], "tensor_parallel_size=3"),
    ("missing", {}, [0], f"lacks torch.ops.symm_mem.{OPS[0]}"),
    ("no-p2p", {}, [0], "no peer-to-peer access to GPU(s) [1]"),
    (None, {"local_ranks": range(0, 1)}, [0], "spans nodes"),
    ("alloc", {}, [1, 0], "symmetric buffer of 524288 bytes not set up: boom"),
    ("wrong", {}, [1, 1, 0], "one-shot check all-reduce of 8192 bytes gave a wrong sum"),
    ("raise", {}, [1, 1, 0], "one-shot check all-reduce of 8192 bytes failed: kernel failed"),
])
def test_setup_stays_on_nccl_and_says_why(caplog, fault, kwargs, agreed, reason):
    world = kwargs.get("world", 2)
    agree = Agree()
    with caplog.at_level(logging.INFO, "kvpilot.engine"):
        tp = setup(FakeOps(world=world, fault=fault), agree, **kwargs)
    assert tp.symm_mem is None
    assert agree.values == agreed  # every rank makes the same calls, so none waits
    assert "all-reduce: " in caplog.text and reason in caplog.text


def test_a_check_that_never_ends_stops_the_start_naming_the_flag():
    # the kernel spins on the GPU: NCCL cannot run behind it, so the engine must not start
    with pytest.raises(RuntimeError, match=r"did not finish in 60 s on tensor-parallel rank 0 "
                                           r".*start with --disable-custom-all-reduce"):
        setup(FakeOps(fault="hang"), Agree())


@pytest.mark.parametrize("step", [0, 1, 2])
def test_another_ranks_no_keeps_the_group_on_nccl(caplog, step):
    others = [1, 1, 1]
    others[step] = 0
    agree = Agree(others)
    with caplog.at_level(logging.INFO, "kvpilot.engine"):
        tp = setup(FakeOps(), agree)
    assert tp.symm_mem is None and len(agree.values) == step + 1
    assert "NCCL for every message (no symmetric memory: another rank cannot use it" \
        in caplog.text


def test_a_worker_logs_only_its_own_reason(caplog):
    with caplog.at_level(logging.INFO, "kvpilot.engine"):
        setup(FakeOps(rank=1, fault="no-p2p"), Agree(), rank=1, device=torch.device("cuda", 1))
        setup(FakeOps(rank=1), Agree(), rank=1, disabled=True)  # rank 0 says the flag
        setup(FakeOps(rank=1), Agree(), rank=1, device=torch.device("cpu"))  # and the device
        setup(FakeOps(rank=1, world=4), Agree(), rank=1, world=4)  # and the fused kernel's rule
        setup(FakeOps(rank=1, fault="fused-wrong"), Agree(), rank=1)
    assert [r.getMessage() for r in caplog.records] == [
        "all-reduce: rank 1 cannot use symmetric memory: no peer-to-peer access to GPU(s) [0]",
        "all-reduce: rank 1 cannot fuse the norm: the fused check gave a wrong sum or norm"]


def test_one_rank_needs_no_setup():
    agree = Agree()
    tp = TPGroup()
    assert setup_symm_mem(tp, AllReduceSettings(False, 64, BF16), CUDA0, range(1), agree,
                          FakeOps()) is tp and agree.values == []


def test_tp_group_sends_small_tensors_through_symmetric_memory(monkeypatch):
    ops = FakeOps(world=2)
    comm = SymmMemAllReduce(ops, torch.zeros(64, dtype=torch.uint8), "tp", 2)
    over_nccl: list[torch.Tensor] = []
    monkeypatch.setattr(groups.dist, "all_reduce", lambda x, group: over_nccl.append(x))
    tp = TPGroup(0, 2, group=GROUP, symm_mem=comm)  # type: ignore[arg-type]
    small = torch.zeros(16)  # 64 bytes: the buffer
    assert tp.all_reduce(small) is small
    assert torch.equal(small, check_input(1, 16, FP32, small.device))  # the peer's added
    big, half = torch.zeros(20), torch.zeros(16, dtype=torch.float16)
    tp.all_reduce(big)
    tp.all_reduce(half)
    assert ops.ran == [ONE_SHOT] and comm.calls == {ONE_SHOT: 1, TWO_SHOT: 0, FUSED: 0, SENT: 0}
    assert over_nccl == [big, half]


def test_tp_group_fuses_the_norm_for_messages_up_to_the_fused_limit():
    ops = FakeOps(world=4)
    comm = SymmMemAllReduce(ops, torch.zeros(2048 * KIB, dtype=torch.uint8), "tp", 4)
    tp = TPGroup(0, 4, group=GROUP, symm_mem=comm)  # type: ignore[arg-type]
    weight = torch.ones(4096, dtype=FP32)
    small = torch.zeros(2, 4096, dtype=FP32)  # 32 KiB: one-shot at 4 ranks
    assert tp.all_reduce_add_rms_norm(small, small, weight, 1e-6) is None  # not agreed on
    comm.fused = True
    out, residual = tp.all_reduce_add_rms_norm(small, torch.ones_like(small), weight, 1e-6)
    peers = sum(check_input(r, small.numel(), FP32, small.device) for r in (1, 2, 3))
    assert torch.equal(residual, 1 + peers.view(small.shape))  # type: ignore[union-attr]
    torch.testing.assert_close(out, F.rms_norm(residual, (4096,), weight, 1e-6))
    assert comm.fused_limit == FUSED_MAX_BYTES[4] == 512 * KIB  # at 2 ranks 1 MiB
    limit = torch.zeros(32, 4096, dtype=FP32)  # 512 KiB: still fused
    assert tp.all_reduce_add_rms_norm(limit, limit, weight, 1e-6) is not None
    above = torch.zeros(33, 4096, dtype=FP32)  # the norm's caller all-reduces
    assert tp.all_reduce_add_rms_norm(above, above, weight, 1e-6) is None
    half = torch.zeros(2, 4096, dtype=torch.float16)  # a dtype the group does not sum
    assert tp.all_reduce_add_rms_norm(half, half, weight, 1e-6) is None
    assert tp.all_reduce_add_rms_norm(small, small[:1], weight, 1e-6) is None  # shapes differ
    assert ops.ran == [FUSED, FUSED] and comm.calls[FUSED] == 2
    assert TPGroup(0, 4, group=GROUP).all_reduce_add_rms_norm(  # type: ignore[arg-type]
        small, small, weight, 1e-6) is None  # no symmetric memory


def test_rows_a_projection_sent_are_summed_by_the_next_fused_call():
    ops = FakeOps()
    comm = SymmMemAllReduce(ops, torch.zeros(64 * KIB, dtype=torch.uint8), "tp", 2)
    x, weight = torch.ones(1, 64, dtype=FP32), torch.ones(4096, 64, dtype=FP32) / 64
    norm = torch.ones(4096, dtype=FP32)
    assert comm.linear_send(x, weight) is None  # the fused kernel is not agreed on
    comm.fused = True
    assert comm.linear_send(x, torch.ones(64 * KIB, 64, dtype=FP32)) is None  # above the limit
    assert comm.linear_send(x.half(), weight.half()) is None  # a dtype the group does not sum
    assert comm.linear_send(x.expand(65, 64), weight) is None  # more rows than the tiled kernel's
    assert comm.linear_send(x[:0], weight) is None  # no rows
    sent = comm.linear_send(x, weight)
    assert sent is not None and torch.equal(sent, torch.ones(1, 4096))
    assert comm.linear_send(x, weight) is None  # one product in the slots at a time
    four = SymmMemAllReduce(FakeOps(world=4), torch.zeros(64 * KIB, dtype=torch.uint8), "tp", 4)
    four.fused = True
    assert four.linear_send(x, weight) is None  # not at 4 ranks (SEND_WORLD_SIZES)
    with pytest.raises(RuntimeError, match="must be the next fused call's x"):
        comm.add_rms_norm(sent.clone(), torch.zeros_like(sent), norm, 1e-6)
    out = comm.add_rms_norm(sent, torch.zeros_like(sent), norm, 1e-6)
    assert out is not None and ops.ran == ["linear_send", SENT]
    assert comm.calls[SENT] == 1 and comm.calls[FUSED] == 0
    assert comm.add_rms_norm(x, x, norm[:64], 1e-6) is not None  # the next one sends its own
    assert ops.ran[-1] == FUSED


def test_flags():
    args = EngineArgs(model="tiny-llama", max_num_seqs=64)
    config = SimpleNamespace(hidden_size=4096, dtype=BF16)
    assert AllReduceSettings.of(args, config) == AllReduceSettings(False, 512 * KIB, BF16)  # type: ignore[arg-type]
    off = EngineArgs(model="tiny-llama", disable_custom_all_reduce=True,
                     custom_all_reduce_max_bytes=4096)
    assert off.to_cli()[-3:] == ["--disable-custom-all-reduce",
                                 "--custom-all-reduce-max-bytes", "4096"]
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, EngineArgs)
    parsed = parser.parse_args(["--model", "tiny-llama", *off.to_cli()[-3:]])
    assert from_namespace(EngineArgs, parsed) == off  # what a worker process parses back
    assert AllReduceSettings.of(off, config) == AllReduceSettings(True, 4096, BF16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"custom_all_reduce_max_bytes=-1 is invalid"):
        EngineArgs(model="tiny-llama", custom_all_reduce_max_bytes=-1)
