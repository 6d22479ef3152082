"""The Triton backend against the torch reference backend on mixed decode/prefill batches."""

from __future__ import annotations

import pytest
import torch
from helpers.paged import BlockAllocation
from kernel_testing import DEVICE, DTYPES, rel_err, tolerance

from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.engine.attention.triton_backend import TritonAttentionBackend


def make_step(query_lens, prefix_lens, block_size, seed):
    """Gives (allocation, metadata on DEVICE) of one step over shuffled blocks."""
    seq_lens = [q + p for q, p in zip(query_lens, prefix_lens, strict=True)]
    alloc = BlockAllocation.shuffled(seq_lens, block_size, seed=seed)
    return alloc, alloc.step(seq_lens, query_lens, DEVICE)


# (query_lens, prefix_lens, heads, kv_heads, head_dim, block_size): decodes first
CASES = [
    ([1, 1, 1], [0, 15, 40], 8, 2, 64, 16),  # decode only (first token, mid-block, ratio 4)
    ([7], [0], 4, 4, 64, 8),  # one fresh prompt, ratio 1
    ([1, 1, 12, 5], [9, 31, 0, 8], 8, 1, 64, 8),  # mixed, chunked prefill onto a prefix
    ([1, 20], [63, 4], 16, 2, 128, 16),  # ratio 8, head_dim 128
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("query_lens", "prefix_lens", "heads", "kv_heads", "head_dim",
                          "block_size"), CASES)
def test_triton_backend_matches_torch_backend(query_lens, prefix_lens, heads, kv_heads,
                                              head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(sum(query_lens) + head_dim)
    alloc, meta = make_step(query_lens, prefix_lens, block_size, seed=sum(query_lens) + head_dim)
    total = sum(query_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    cache = rand(2, alloc.num_blocks, block_size, kv_heads, head_dim)
    q, k, v = rand(total, heads, head_dim), rand(total, kv_heads, head_dim), rand(
        total, kv_heads, head_dim)
    cache_ref = cache.clone()
    want = TorchAttentionBackend().forward(q, k, v, cache_ref, meta, head_dim**-0.5)
    got = TritonAttentionBackend(num_sms=4).forward(q, k, v, cache, meta, head_dim**-0.5)
    assert torch.equal(cache, cache_ref)  # the same slots were written with the same values
    assert rel_err(got, want) < tolerance(dtype)
