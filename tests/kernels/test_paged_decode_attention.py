"""Paged decode attention against its torch reference (CPU interpreter, fp16/fp32)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import DEVICE, DTYPES, rel_err, tolerance
from paged_fixtures import random_paged_cache

from kvpilot.kernels.paged_decode_attention import (
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)

# (seq_lens, num_heads, num_kv_heads, head_dim, block_size, num_splits, block_n)
CASES = [
    ([1], 4, 4, 64, 8, 1, 16),  # length 1, GQA ratio 1
    ([8, 16, 9], 8, 2, 64, 8, 2, 16),  # on and across block boundaries, ratio 4
    ([33, 1, 17], 16, 2, 64, 16, 3, 16),  # ratio 8, more splits than some seqs need
    ([40], 8, 1, 128, 32, 2, 32),  # head_dim 128, ratio 8, multi-page tiles
    ([5, 64], 4, 1, 256, 64, 1, 16),  # head_dim 256, block_size 64
    ([0, 7], 4, 2, 64, 8, 2, 16),  # a padded row (seq_len 0) gives zeros, no NaN
    ([0, 7], 4, 2, 64, 8, 1, 16),  # one split writes the output itself: zeros there too
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("seq_lens", "heads", "kv_heads", "head_dim", "block_size",
                          "splits", "block_n"), CASES)
def test_decode_matches_reference(seq_lens, heads, kv_heads, head_dim, block_size, splits,
                                  block_n, dtype):
    gen = torch.Generator().manual_seed(len(seq_lens) * 1000 + head_dim + heads)
    cache, tables = random_paged_cache(seq_lens, kv_heads, head_dim, block_size, dtype,
                                       DEVICE, gen)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    paged_decode_attention(q, cache, tables, lens, scale, num_splits=splits, out=out,
                           block_n=block_n)
    ref = paged_decode_attention_ref(q, cache, tables, lens, scale)
    empty = lens == 0
    assert torch.equal(out[empty].float(), torch.zeros_like(out[empty].float()))
    if (~empty).any():
        assert rel_err(out[~empty], ref[~empty]) < tolerance(dtype)


@settings(max_examples=6, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       ratio=st.sampled_from([1, 4, 8]), splits=st.integers(1, 4))
def test_decode_any_split_count_gives_the_same_output(lens, ratio, splits):
    """Splitting is an implementation detail: any split count gives the reference output."""
    gen = torch.Generator().manual_seed(sum(lens) * 7 + ratio + splits)
    cache, tables = random_paged_cache(lens, 1, 32, 8, torch.float32, DEVICE, gen)
    q = torch.randn(len(lens), ratio, 32, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, cache, tables, seq_lens, 0.3, num_splits=splits, block_n=16)
    ref = paged_decode_attention_ref(q, cache, tables, seq_lens, 0.3)
    assert rel_err(out, ref) < tolerance(torch.float32)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_launch_order_changes_no_output_bit(splits):
    """`order` only reorders the launch: each row's output stays in its row, bit for bit."""
    lens = [9, 40, 1, 23, 0, 31]
    gen = torch.Generator().manual_seed(5)
    cache, tables = random_paged_cache(lens, 2, 32, 8, torch.float32, DEVICE, gen)
    q = torch.randn(len(lens), 4, 32, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    plain = paged_decode_attention(q, cache, tables, seq_lens, 0.3, num_splits=splits,
                                   block_n=16)
    for order in (torch.tensor([1, 5, 3, 0, 2, 4]), torch.arange(5, -1, -1)):
        ordered = paged_decode_attention(q, cache, tables, seq_lens, 0.3, num_splits=splits,
                                         block_n=16, order=order.to(DEVICE))
        assert torch.equal(ordered, plain)


@pytest.mark.parametrize(("seqs", "kv_heads", "max_len", "expected"), [
    (64, 8, 4096, 1),  # 512 programs already fill 132 SMs ~4 deep
    (64, 4, 4096, 1),  # 256 programs (a TP=2 shard): a program per SM, no split
    (32, 4, 1024, 4),  # 128 programs: split to ~3 per SM
    (16, 8, 4096, 4),
    (1, 8, 4096, 16),  # one sequence: ~3 programs per SM wanted, capped by 256-token floor
    (1, 8, 100, 1),  # short context: never a split under 256 tokens
    (256, 8, 1024, 1),
])
def test_default_num_splits(seqs, kv_heads, max_len, expected):
    assert default_num_splits(seqs, kv_heads, max_len) == expected
