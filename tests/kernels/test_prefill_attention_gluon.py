"""The Gluon prefill kernel (Hopper): compiled for sm_90a on any machine, which kernel the launcher
takes, and its output against the torch reference on an H100."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_testing import ON_GPU, rel_err, tolerance
from paged_fixtures import random_paged_cache

from kvpilot.kernels import paged_prefill_attention as prefill_launcher
from kvpilot.kernels import prefill_attention_gluon as gluon_kernel
from kvpilot.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from kvpilot.kernels.prefill_attention_gluon import MAX_REGS, gluon_prefill_ok

HERE = Path(__file__).parent
H100_SHARED_BYTES = 227 * 1024  # the most one block may ask for on compute capability 9.0
on_hopper = pytest.mark.skipif(
    not (ON_GPU and torch.cuda.get_device_capability()[0] == 9),
    reason="needs a Hopper GPU (compute capability 9.x) with compiled Triton")


def test_kernel_compiles_for_hopper_within_its_budget():
    """Triton compiles the warp-specialised kernel for sm_90a here, no GPU needed: every case the
    GPU tests run fits an H100's shared memory, issues warpgroup MMAs, reallocates registers
    between its partitions, spills nothing, and stores two output columns an instruction (its
    output strides specialised: unspecialised, one column at a time ran the kernel at 0.83-0.96x
    of what it did, bench/results/issue21-H100-2026-11-28/) where a partial half-tile ends a
    sequence, and whole half-tiles leave by TMA."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(HERE / "gluon_compile.py")], capture_output=True,
                          text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(cases) == 4 and [case["prefix"] for case in cases].count(True) == 1
    for case in cases:
        assert 0 < case["shared"] <= H100_SHARED_BYTES, case
        assert case["cubin"] > 0 and case["wgmma"] > 0 and case["setmaxnreg"], case
        assert case["stores"] == ["st.global.b32"] and case["tma_store"], case
        if "stack" in case:  # (cuobjdump comes with Triton's CUDA tools)
            assert case["stack"] == case["local"] == 0 and case["reg"] <= MAX_REGS, case


def _qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
         device: str = "cpu", fused: bool = True):
    """q, k, v as the engine's: views of one [tokens, (heads + 2 kv_heads) * head_dim] tensor."""
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim).to(dtype=dtype, device=device)
    if not fused:
        qkv = qkv.clone()
        return (qkv[:, :heads].contiguous(), qkv[:, heads:heads + kv_heads].contiguous(),
                qkv[:, heads + kv_heads:].contiguous())
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    return q, k, v


def test_gluon_prefill_ok_says_which_batches_it_takes():
    hopper = (9, 0)
    q, k, v = _qkv(8, 4, 2, 128, torch.bfloat16)
    assert gluon_prefill_ok(q, k, v, 0, hopper)
    assert gluon_prefill_ok(*_qkv(8, 4, 4, 64, torch.float16), 0, hopper)
    assert not gluon_prefill_ok(q, k, v, 0)  # CPU tensors
    assert not gluon_prefill_ok(q, k, v, 0, (8, 0))  # no warpgroup MMA before Hopper
    assert not gluon_prefill_ok(q, k, v, 0, (10, 0))  # nor on Blackwell (tcgen05)
    assert not gluon_prefill_ok(q, k, v, None, hopper)  # the prefixes unknown
    assert not gluon_prefill_ok(q, k, v, 16, hopper)  # a cached prefix
    assert not gluon_prefill_ok(*_qkv(8, 4, 2, 128, torch.float32), 0, hopper)
    assert not gluon_prefill_ok(*_qkv(8, 4, 2, 256, torch.bfloat16), 0, hopper)
    heads_outermost = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not gluon_prefill_ok(heads_outermost, k, v, 0, hopper)


def test_gluon_prefill_ok_never_on_rocm(monkeypatch):
    """ROCm's torch reports an MI300X as compute capability 9.4: not a Hopper."""
    q, k, v = _qkv(8, 4, 2, 128, torch.bfloat16)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not gluon_prefill_ok(q, k, v, 0, (9, 4))
    assert not gluon_prefill_ok(q, k, v, 0, (9, 0))


def test_use_gluon_refuses_what_it_cannot_run():
    q, k, v = _qkv(4, 2, 2, 128, torch.bfloat16)
    with pytest.raises(ValueError, match=r"use_gluon: needs .* no cached prefix"):
        paged_prefill_attention(q, k, v, torch.zeros(2, 1, 8, 2, 128), torch.zeros(1, 1).int(),
                                torch.tensor([0, 4]).int(), torch.tensor([4]).int(), 4, 1.0,
                                max_prefix_len=0, use_gluon=True)


def _case(query_lens, heads, kv_heads, head_dim, dtype, decode_rows=0, fused=True, seed=0):
    """Gives (q, k, v, starts, max_query_len) of a no-prefix batch on the GPU; `decode_rows`
    leading rows belong to no prefill sequence (the engine's decode rows come first)."""
    torch.manual_seed(seed)
    total = decode_rows + sum(query_lens)
    q, k, v = _qkv(total, heads, kv_heads, head_dim, dtype, "cuda", fused)
    starts = torch.tensor([decode_rows + s for s in [0, *torch.tensor(query_lens).cumsum(0)]],
                          dtype=torch.int32, device="cuda")
    return q, k, v, starts, max(query_lens)


def _reference(q, k, v, starts, query_lens, head_dim):
    cache = torch.zeros(2, 1, 16, k.shape[1], head_dim, dtype=q.dtype, device="cuda")
    tables = torch.zeros(len(query_lens), 1, dtype=torch.int32, device="cuda")
    lens = torch.tensor(query_lens, dtype=torch.int32, device="cuda")
    return paged_prefill_attention_ref(q, k, v, cache, tables, starts, lens, head_dim**-0.5)


# (query_lens, heads, kv_heads, head_dim): every tile shape at a sequence's end (1 row, a
# half tile, 64 +- 1, a full tile +- 1), long sequences, GQA groups of 1, 4 and 8
CASES = [
    ([1, 63, 64, 65, 127, 128, 129, 200, 1000, 2049], 4, 4, 128),
    ([1, 63, 64, 65, 127, 128, 129, 200, 1000, 2049], 8, 2, 128),
    ([300, 5, 1024, 77], 16, 2, 64),
]


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("query_lens", "heads", "kv_heads", "head_dim"), CASES)
def test_gluon_prefill_matches_reference(query_lens, heads, kv_heads, head_dim, dtype):
    """Through the launcher, which takes the Gluon kernel for a no-prefix batch on its own;
    rows before the first sequence (decode rows) are never written."""
    q, k, v, starts, max_len = _case(query_lens, heads, kv_heads, head_dim, dtype, decode_rows=3)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    assert gluon_prefill_ok(q, k, v, max_prefix_len=0)
    paged_prefill_attention(q, k, v, torch.zeros(2, 1, 16, kv_heads, head_dim, device="cuda"),
                            torch.zeros(len(query_lens), 1, dtype=torch.int32, device="cuda"),
                            starts, torch.tensor(query_lens, dtype=torch.int32, device="cuda"),
                            max_len, head_dim**-0.5, out=out, max_prefix_len=0)
    assert out[:3].isnan().all()
    ref = _reference(q, k, v, starts, query_lens, head_dim)
    assert rel_err(out[3:], ref[3:]) < tolerance(dtype)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize(("programs", "q_buffers", "stages", "l2_bytes"),
                         [(5, 1, 3, 10 << 20), (3, 2, 2, 1), (7, 1, 2, 64 << 20)])
def test_gluon_prefill_schedules(programs, q_buffers, stages, l2_bytes):
    """Few programs (each takes many tiles: the rings wrap many times), other buffer counts,
    and L2 groups of one pair and of every pair; q/k/v in separate tensors."""
    query_lens = [129, 1, 700, 64, 333]
    q, k, v, starts, max_len = _case(query_lens, 8, 2, 128, torch.bfloat16, fused=False, seed=1)
    out = gluon_kernel.gluon_prefill_attention(q, k, v, starts, max_len, 128**-0.5,
                                               q_buffers=q_buffers, stages=stages,
                                               l2_bytes=l2_bytes, programs=programs)
    ref = _reference(q, k, v, starts, query_lens, 128)
    assert rel_err(out, ref) < tolerance(torch.bfloat16)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("tma_rows", [True, False])
def test_gluon_prefill_writes_only_its_rows(tma_rows):
    """Whole half-tiles leave by TMA where the output's rows allow a descriptor, the rest (and
    every row of an output whose heads are not contiguous) by masked stores: either way each
    sequence's rows are written, and nothing around them (the decode rows before, the padding
    columns of a strided output)."""
    query_lens = [64, 1, 128, 65, 257, 192]
    q, k, v, starts, max_len = _case(query_lens, 8, 2, 128, torch.bfloat16, decode_rows=5)
    width = 128 if tma_rows else 136  # heads 136 apart: no TMA descriptor over the rows
    out = torch.full((q.shape[0], 8, width), float("nan"), dtype=q.dtype, device="cuda")
    gluon_kernel.gluon_prefill_attention(q, k, v, starts, max_len, 128**-0.5,
                                         out=out[..., :128])
    ref = _reference(q, k, v, starts, query_lens, 128)
    assert out[:5].isnan().all() and out[..., 128:].isnan().all()
    assert rel_err(out[5:, :, :128], ref[5:]) < tolerance(torch.bfloat16)


@pytest.mark.gpu
@on_hopper
def test_launcher_takes_gluon_only_without_a_prefix(monkeypatch):
    calls = []
    real = gluon_kernel.gluon_prefill_attention
    monkeypatch.setattr(gluon_kernel, "gluon_prefill_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, starts, max_len = _case([100, 30], 4, 2, 128, torch.bfloat16)
    args = (q, k, v, torch.zeros(2, 1, 16, 2, 128, dtype=q.dtype, device="cuda"),
            torch.zeros(2, 1, dtype=torch.int32, device="cuda"), starts,
            torch.tensor([100, 30], dtype=torch.int32, device="cuda"), max_len, 128**-0.5)
    for max_prefix_len in (None, 0):
        paged_prefill_attention(*args, max_prefix_len=max_prefix_len)
    assert calls == [1]


def _prefixed_case(query_lens, prefix_lens, heads, kv_heads, head_dim, block_size, dtype, device,
                   decode_rows=0, seed=0):
    """Gives (q, k, v, cache, tables, starts, lens, host starts, host lens): a batch whose
    sequences have cached prefixes in a shuffled paged cache, spare slots poisoned with NaN;
    `decode_rows` leading rows belong to no sequence."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + p for q, p in zip(query_lens, prefix_lens, strict=True)]
    cache, tables = random_paged_cache(seq_lens, kv_heads, head_dim, block_size, dtype, device,
                                       gen)
    q, k, v = _qkv(decode_rows + sum(query_lens), heads, kv_heads, head_dim, dtype, device)
    starts_cpu = [decode_rows + s for s in [0, *torch.tensor(query_lens).cumsum(0).tolist()]]
    starts = torch.tensor(starts_cpu, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k, v, cache, tables, starts, lens, starts_cpu, seq_lens


def test_gather_prefixed_kv_lays_out_each_sequence():
    """Each sequence's keys are its cached prefix (from its own blocks, in order) then its new
    rows of k and v, from kv_starts[b]; the slots after its last key are zeros, not the
    cache's NaN-poisoned tail."""
    query_lens, prefix_lens, block_size = [3, 20, 1], [0, 17, 32], 8
    _, k, v, cache, tables, _, lens, starts_cpu, seq_lens = _prefixed_case(
        query_lens, prefix_lens, 4, 2, 16, block_size, torch.float32, "cpu", decode_rows=2)
    gathered = gluon_kernel.gather_prefixed_kv(k, v, cache, tables, lens, starts_cpu, seq_lens)
    assert gathered.max_seq_len == max(seq_lens) and gathered.seq_lens is lens
    kv_starts = gathered.kv_starts.tolist()
    ends = [*kv_starts[1:], gathered.k.shape[0]]
    for b, (q_len, prefix) in enumerate(zip(query_lens, prefix_lens, strict=True)):
        pos = torch.arange(prefix)
        slots = tables[b, pos // block_size].long() * block_size + pos % block_size
        for i, new in ((0, k), (1, v)):
            rows = (gathered.k, gathered.v)[i][kv_starts[b]:ends[b]]
            cached = cache[i].reshape(-1, *cache.shape[3:])[slots]
            assert torch.equal(rows[:prefix], cached)
            assert torch.equal(rows[prefix:prefix + q_len],
                               new[starts_cpu[b]:starts_cpu[b] + q_len])
            assert not rows[prefix + q_len:].any()  # zeros (a NaN is truthy)
    assert not gathered.k.isnan().any() and not gathered.v.isnan().any()


def test_which_prefixed_batches_gather_for_gluon(monkeypatch):
    """A batch with cached prefixes runs on the Gluon kernel (keys gathered) only where the
    kernel takes it prefixes aside (here: as on a Hopper), the host's lengths are given, the
    cache holds q's dtype, every sequence has GATHER_MIN_QUERY new tokens and the gathered
    keys fit GATHER_MAX_BYTES."""
    monkeypatch.setattr(prefill_launcher, "_gluon_takes",
                        lambda q, k, v, max_prefix_len: max_prefix_len == 0)
    q, k, v, cache, _, _, _, starts_cpu, seq_lens = _prefixed_case(
        [128, 200], [16, 0], 2, 2, 64, 16, torch.bfloat16, "cpu")
    gathers = prefill_launcher._gluon_gathers
    assert gathers(q, k, v, cache, starts_cpu, seq_lens)
    assert not gathers(q, k, v, cache, None, seq_lens)
    assert not gathers(q, k, v, cache, starts_cpu, None)
    assert not gathers(q, k, v, cache.float(), starts_cpu, seq_lens)  # not q's dtype
    short = [0, 127, 327]  # the first sequence one token short
    assert not gathers(q[:327], k[:327], v[:327], cache, short, [143, 200])
    # K and V, 2 heads x 64 x 2 bytes a row, rows of whole blocks (144 and 208) plus a block each
    needed = 2 * (2 * 64 * 2) * (144 + 16 + 208 + 16)
    monkeypatch.setattr(gluon_kernel, "GATHER_MAX_BYTES", needed)
    assert gathers(q, k, v, cache, starts_cpu, seq_lens)
    monkeypatch.setattr(gluon_kernel, "GATHER_MAX_BYTES", needed - 1)
    assert not gathers(q, k, v, cache, starts_cpu, seq_lens)
    monkeypatch.setattr(gluon_kernel, "GATHER_PREFIX", False)
    monkeypatch.setattr(gluon_kernel, "GATHER_MAX_BYTES", 1 << 30)
    assert not gathers(q, k, v, cache, starts_cpu, seq_lens)


# (query_lens, prefix_lens, heads, kv_heads, head_dim, block_size): prefixes on and off block
# and K/V-tile boundaries, no prefix beside prefixes, a long prefix, GQA 1, 4 and 8
PREFIXED_CASES = [
    ([128, 300, 129], [0, 17, 1000], 8, 2, 128, 16),
    ([2049, 128], [4096, 5], 32, 8, 128, 16),
    ([500, 640], [193, 128], 16, 16, 64, 32),
]


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("query_lens", "prefix_lens", "heads", "kv_heads", "head_dim",
                          "block_size"), PREFIXED_CASES)
def test_gluon_prefill_with_cached_prefixes(query_lens, prefix_lens, heads, kv_heads, head_dim,
                                            block_size, dtype):
    """Through the launcher with the host's lengths: keys gathered from a shuffled, NaN-poisoned
    paged cache; decode rows before the first sequence are never written."""
    q, k, v, cache, tables, starts, lens, starts_cpu, seq_lens = _prefixed_case(
        query_lens, prefix_lens, heads, kv_heads, head_dim, block_size, dtype, "cuda",
        decode_rows=3, seed=len(query_lens))
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    paged_prefill_attention(q, k, v, cache, tables, starts, lens, max(query_lens),
                            head_dim**-0.5, out=out, max_prefix_len=None, use_gluon=True,
                            query_start_loc_cpu=starts_cpu, seq_lens_cpu=seq_lens)
    assert out[:3].isnan().all()
    ref = paged_prefill_attention_ref(q, k, v, cache, tables, starts, lens, head_dim**-0.5)
    assert rel_err(out[3:], ref[3:]) < tolerance(dtype)


def test_gather_reserve_bytes(monkeypatch):
    """The memory an engine keeps beside its KV cache for one layer's gathered keys: on a
    Hopper GPU with a 16-bit cache, the bound given, at most GATHER_MAX_BYTES; else none."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    reserve = prefill_launcher.gather_reserve_bytes
    assert reserve(cuda, torch.bfloat16, 4096, 1000) == 4096 * 1000
    assert reserve(cuda, torch.float16, 4096, 1 << 20) == gluon_kernel.GATHER_MAX_BYTES
    assert reserve(cuda, torch.float8_e4m3fn, 4096, 1000) == 0  # fp8: the Triton kernel
    assert reserve(torch.device("cpu"), torch.bfloat16, 4096, 1000) == 0
    monkeypatch.setattr(gluon_kernel, "GATHER_PREFIX", False)
    assert reserve(cuda, torch.bfloat16, 4096, 1000) == 0
    monkeypatch.setattr(gluon_kernel, "GATHER_PREFIX", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert reserve(cuda, torch.bfloat16, 4096, 1000) == 0
