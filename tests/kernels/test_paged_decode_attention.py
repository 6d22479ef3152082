"""Paged decode attention against its torch reference (CPU interpreter, fp16/fp32)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import DEVICE, DTYPES, rel_err, tolerance
from paged_fixtures import random_paged_cache

from kvpilot.kernels.paged_decode_attention import (
    DecodePrologue,
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kvpilot.kernels.qk_norm_rotary import QKNormRope, qk_norm_rotary
from kvpilot.kernels.rotary import rotary_cos_sin_cache

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "ordered"),
                         [(4, 2, 64, False), (2, 2, 128, True)])
def test_prologue_gives_the_bits_of_qk_norm_rotary_then_attention(heads, kv_heads, head_dim,
                                                                  ordered, dtype):
    """A Qwen3 decode step's q/k norms, rotary and KV write inside decode attention: the same
    output, q/k rows and cache, bit for bit, as `qk_norm_rotary` launched before it; a padded
    row (length 0, slot -1) caches nothing."""
    lens = [9, 40, 0, 23, 17]
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    cache, tables = random_paged_cache(lens, kv_heads, head_dim, 8, dtype, DEVICE, gen)
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    weights = (1 + torch.randn(2, head_dim, generator=gen) / 4).to(dtype=dtype, device=DEVICE)
    norm = QKNormRope(torch.tensor([max(n - 1, 0) for n in lens], device=DEVICE),
                      weights[0], weights[1], 1e-6, rotary_cos_sin_cache(head_dim, 64, device=DEVICE))
    slots = torch.tensor([int(tables[i, (n - 1) // 8]) * 8 + (n - 1) % 8 if n else -1
                          for i, n in enumerate(lens)], device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    order = torch.tensor([1, 3, 4, 0, 2], device=DEVICE) if ordered else None
    runs = []
    for fused in (False, True):
        rows, kv = qkv.to(DEVICE).clone(), cache.clone()
        q, k, v = rows.split([heads, kv_heads, kv_heads], dim=1)
        if fused:
            out = paged_decode_attention(q, kv, tables, seq_lens, 0.3, num_splits=1, order=order,
                                         prologue=DecodePrologue(norm, k, v, slots))
        else:
            qk_norm_rotary(norm.positions, q, k, norm.q_weight, norm.k_weight, norm.eps,
                           norm.cos_sin, v=v, kv_cache=kv, slot_mapping=slots)
            out = paged_decode_attention(q, kv, tables, seq_lens, 0.3, num_splits=1, order=order)
        runs.append((out, rows, kv))
    (out, rows, kv), (fused_out, fused_rows, fused_kv) = runs
    assert torch.equal(fused_out, out) and torch.equal(fused_rows, rows)
    assert torch.equal(fused_kv.nan_to_num(7.0), kv.nan_to_num(7.0))
    assert not torch.equal(kv.nan_to_num(7.0), cache.nan_to_num(7.0))  # the step was cached


def test_prologue_needs_one_split():
    q = torch.zeros(1, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 1, 8, 1, 64, device=DEVICE)
    norm = QKNormRope(torch.zeros(1, dtype=torch.long, device=DEVICE), q[0, 0], q[0, 0], 1e-6,
                      rotary_cos_sin_cache(64, 8, device=DEVICE))
    prologue = DecodePrologue(norm, q[:, :1], q[:, 1:], torch.zeros(1, dtype=torch.long,
                                                                      device=DEVICE))
    with pytest.raises(AssertionError, match="one split"):
        paged_decode_attention(q, cache, torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
                               torch.ones(1, dtype=torch.int32, device=DEVICE), 1.0,
                               num_splits=2, prologue=prologue)


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
