"""Paged prefill attention against its torch reference (CPU interpreter, fp16/fp32)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import DEVICE, DTYPES, rel_err, tolerance
from paged_fixtures import random_paged_cache

from kvpilot.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
    tma_layout_ok,
)


def run_case(query_lens, prefix_lens, heads, kv_heads, head_dim, block_size, dtype, seed,
             block_m=16, block_n=16, use_tma=False, fused_qkv=False):
    """Gives (kernel output, reference output) for one random batch; `fused_qkv`: q, k and v
    are views of one [tokens, (heads + 2 * kv_heads) * head_dim] tensor, as the engine's."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + p for q, p in zip(query_lens, prefix_lens, strict=True)]
    # only the prefix is in the cache; the new tokens' K/V come from k and v
    cache, tables = random_paged_cache(seq_lens, kv_heads, head_dim, block_size, dtype,
                                       DEVICE, gen)
    total = sum(query_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    if fused_qkv:
        qkv = rand(total, heads + 2 * kv_heads, head_dim)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    else:
        q, k, v = rand(total, heads, head_dim), rand(total, kv_heads, head_dim), rand(
            total, kv_heads, head_dim)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                          device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    scale = head_dim**-0.5
    paged_prefill_attention(q, k, v, cache, tables, starts, lens, max(query_lens), scale,
                            out=out, block_m=block_m, block_n=block_n, num_warps=4,
                            num_stages=1, use_tma=use_tma)
    return out, paged_prefill_attention_ref(q, k, v, cache, tables, starts, lens, scale)


# (query_lens, prefix_lens, heads, kv_heads, head_dim, block_size)
CASES = [
    ([1], [0], 2, 2, 64, 8),  # one token, no prefix, ratio 1
    ([16, 17, 1], [0, 0, 0], 8, 2, 64, 8),  # on/across tile and block boundaries, ratio 4
    ([5, 9], [8, 13], 8, 1, 64, 8),  # cached prefix on and off a block boundary, ratio 8
    ([33], [16], 4, 4, 128, 16),  # three query tiles, head_dim 128
    ([3, 1], [64, 5], 2, 1, 256, 64),  # head_dim 256, block_size 64, decode-like rows
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("query_lens", "prefix_lens", "heads", "kv_heads", "head_dim",
                          "block_size"), CASES)
def test_prefill_matches_reference(query_lens, prefix_lens, heads, kv_heads, head_dim,
                                   block_size, dtype):
    out, ref = run_case(query_lens, prefix_lens, heads, kv_heads, head_dim, block_size, dtype,
                        seed=sum(query_lens) + head_dim)
    assert rel_err(out, ref) < tolerance(dtype)


@pytest.mark.parametrize(("query_lens", "prefix_lens", "heads", "kv_heads", "head_dim",
                          "block_size"), CASES[1:4])
def test_prefill_tma_matches_reference(query_lens, prefix_lens, heads, kv_heads, head_dim,
                                       block_size):
    """The TMA kernel: descriptor tiles that run into the next sequence's rows and past the
    tensor's end, a cached prefix, q/k/v as views of one fused tensor."""
    out, ref = run_case(query_lens, prefix_lens, heads, kv_heads, head_dim, block_size,
                        torch.float32, seed=sum(query_lens) + head_dim + 1, block_m=32,
                        use_tma=True, fused_qkv=True)
    assert rel_err(out, ref) < tolerance(torch.float32)


def test_prefill_tma_refuses_a_layout_without_contiguous_heads():
    q = torch.zeros(4, 2, 16).transpose(0, 1).contiguous().transpose(0, 1)  # heads outermost
    with pytest.raises(ValueError, match=r"use_tma: .*heads are contiguous within a token"):
        paged_prefill_attention(q, q, q, torch.zeros(2, 1, 8, 2, 16), torch.zeros(1, 1).int(),
                                torch.tensor([0, 4]).int(), torch.tensor([4]).int(), 4, 1.0,
                                use_tma=True)


def test_prefill_tma_never_on_rocm(monkeypatch):
    """ROCm's torch reports an MI300X as compute capability 9.4: the pointer kernel serves it,
    and asking for TMA there is a ValueError."""
    q = torch.zeros(4, 2, 16)
    assert tma_layout_ok(q, q, q)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not tma_layout_ok(q, q, q)
    with pytest.raises(ValueError, match=r"use_tma: needs an NVIDIA GPU \(not ROCm\)"):
        paged_prefill_attention(q, q, q, torch.zeros(2, 1, 8, 2, 16), torch.zeros(1, 1).int(),
                                torch.tensor([0, 4]).int(), torch.tensor([4]).int(), 4, 1.0,
                                use_tma=True)


def test_prefill_uneven_tiles():
    """block_m larger than block_n: several unmasked K tiles left of the diagonal."""
    out, ref = run_case([40], [3], 2, 1, 32, 8, torch.float32, seed=3, block_m=32, block_n=16)
    assert rel_err(out, ref) < tolerance(torch.float32)


def test_prefill_rejects_tiles_that_split_the_diagonal():
    q = torch.zeros(1, 1, 16)
    with pytest.raises(AssertionError, match="block_m=16 must be a multiple of block_n=32"):
        paged_prefill_attention(q, q, q, torch.zeros(2, 1, 8, 1, 16), torch.zeros(1, 1).int(),
                                torch.tensor([0, 1]).int(), torch.tensor([1]).int(), 1, 1.0,
                                block_m=16, block_n=32)


@settings(max_examples=5, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 24), st.integers(0, 20)), min_size=1, max_size=3),
       ratio=st.sampled_from([1, 4, 8]))
def test_prefill_property_matches_reference(lens, ratio):
    query_lens, prefix_lens = [q for q, _ in lens], [p for _, p in lens]
    out, ref = run_case(query_lens, prefix_lens, ratio, 1, 32, 8, torch.float32,
                        seed=sum(query_lens) * 31 + sum(prefix_lens))
    assert rel_err(out, ref) < tolerance(torch.float32)
