"""Unified paged attention (one graph-safe launch for a mixed batch) against the prefill
kernel's torch reference: decodes, prompt chunks with and without a cached prefix, padding
sequences, and rows of no sequence left untouched (CPU interpreter, fp16/fp32)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, DTYPES, rel_err, tolerance
from paged_fixtures import random_paged_cache

from kvpilot.kernels.paged_prefill_attention import paged_prefill_attention_ref
from kvpilot.kernels.unified_attention import unified_attention


def run_case(query_lens, prefix_lens, heads, kv_heads, head_dim, block_size, dtype, seed,
             pad_seqs=0, pad_tokens=0, block_q=None, block_n=16):
    """Gives (kernel output, reference output, the padding rows' output) for one batch: the
    new tokens' K/V written into the cache first, as the engine's step does."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + p for q, p in zip(query_lens, prefix_lens, strict=True)]
    cache, tables = random_paged_cache(seq_lens, kv_heads, head_dim, block_size, dtype,
                                       DEVICE, gen)
    total = sum(query_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    q = rand(total + pad_tokens, heads, head_dim)
    k, v = rand(total, kv_heads, head_dim), rand(total, kv_heads, head_dim)
    row = 0
    for b, (n, p) in enumerate(zip(query_lens, prefix_lens, strict=True)):
        for j in range(n):
            pos = p + j
            block, off = int(tables[b, pos // block_size]), pos % block_size
            cache[0, block, off], cache[1, block, off] = k[row], v[row]
            row += 1
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    # padding sequences: length 0, their start the batch's end (the graph's static buffers)
    starts_t = torch.tensor(starts + [total] * pad_seqs, dtype=torch.int32, device=DEVICE)
    lens_t = torch.tensor(seq_lens + [0] * pad_seqs, dtype=torch.int32, device=DEVICE)
    tables_t = torch.cat([tables, torch.zeros(pad_seqs, tables.shape[1], dtype=tables.dtype,
                                              device=tables.device)])
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    scale = head_dim**-0.5
    unified_attention(q, cache, tables_t, starts_t, lens_t, scale, out, block_q=block_q,
                      block_n=block_n)
    ref = paged_prefill_attention_ref(q[:total], k, v, cache, tables, starts_t[:len(starts)],
                                      lens_t[:len(seq_lens)], scale)
    return out[:total], ref, out[total:]


# (query_lens, prefix_lens, heads, kv_heads, head_dim, block_size)
CASES = [
    ([1], [0], 2, 2, 64, 8),  # one token, no prefix
    ([1, 1, 1], [7, 30, 2], 4, 2, 64, 8),  # decode rows only, GQA 2
    ([1, 1, 20, 1], [9, 16, 0, 3], 8, 2, 64, 8),  # decodes around a fresh prompt chunk
    ([5, 17, 1], [8, 13, 40], 8, 1, 64, 8),  # cached prefixes on and off a block boundary
    ([33, 4], [16, 0], 4, 4, 128, 16),  # several query blocks, head_dim 128, no GQA
    ([3, 6], [21, 5], 6, 2, 64, 8),  # group 3: rows per program not a power of two
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_matches_the_reference(case, dtype):
    out, ref, _ = run_case(*case, dtype=dtype, seed=len(case[0]))
    assert rel_err(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("block_q", [1, 4, 8])
def test_every_query_block_size_covers_every_token(block_q):
    """Blocks that split sequences at different points (the binary search's boundaries)."""
    out, ref, _ = run_case([7, 1, 12, 2], [3, 20, 0, 9], 4, 2, 64, 8, torch.float32, seed=3,
                           block_q=block_q)
    assert rel_err(out, ref) < tolerance(torch.float32)


def test_padding_sequences_and_rows_are_left_alone():
    """A graph's batch: fewer sequences than the buffers hold, fewer tokens than the bucket;
    the padding rows (no sequence) keep what they held."""
    out, ref, padding = run_case([1, 9, 1], [12, 4, 5], 4, 2, 64, 8, torch.float32, seed=5,
                                 pad_seqs=5, pad_tokens=6)
    assert rel_err(out, ref) < tolerance(torch.float32)
    assert padding.shape[0] == 6 and torch.isnan(padding).all()
