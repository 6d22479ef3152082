"""The Triton backend against the torch reference backend on mixed decode/prefill batches."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, DTYPES, rel_err, tolerance

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.engine.attention.triton_backend import TritonAttentionBackend


def make_step(query_lens, prefix_lens, block_size, num_blocks, gen):
    """Gives the metadata of one step whose sequences own disjoint shuffled blocks."""
    seq_lens = [q + p for q, p in zip(query_lens, prefix_lens, strict=True)]
    width = max(-(-n // block_size) for n in seq_lens)
    order = torch.randperm(num_blocks, generator=gen)
    tables = order[: len(seq_lens) * width].view(len(seq_lens), width).int()
    slots, starts = [], [0]
    for i, (q, p) in enumerate(zip(query_lens, prefix_lens, strict=True)):
        pos = torch.arange(p, p + q)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
        starts.append(starts[-1] + q)
    decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), num_decode_tokens=decodes,
        query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens)


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
    num_blocks = 64
    meta = make_step(query_lens, prefix_lens, block_size, num_blocks, gen)
    total = sum(query_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    cache = rand(2, num_blocks, block_size, kv_heads, head_dim)
    q, k, v = rand(total, heads, head_dim), rand(total, kv_heads, head_dim), rand(
        total, kv_heads, head_dim)
    cache_ref = cache.clone()
    want = TorchAttentionBackend().forward(q, k, v, cache_ref, meta, head_dim**-0.5)
    got = TritonAttentionBackend(num_sms=4).forward(q, k, v, cache, meta, head_dim**-0.5)
    assert torch.equal(cache, cache_ref)  # the same slots were written with the same values
    assert rel_err(got, want) < tolerance(dtype)
