"""The Triton backend against the torch reference backend on mixed decode/prefill batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.paged import BlockAllocation
from kernel_testing import DEVICE, DTYPES, rel_err, tolerance

from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.engine.attention.triton_backend import TritonAttentionBackend


def make_step(query_lens, prefix_lens, block_size, seed):
    """Gives (allocation, metadata on DEVICE) of one step over shuffled blocks, with the count
    of prefill sequences up to the last one with a prefix as `pack_step` gives it."""
    seq_lens = [q + p for q, p in zip(query_lens, prefix_lens, strict=True)]
    alloc = BlockAllocation.shuffled(seq_lens, block_size, seed=seed)
    meta = alloc.step(seq_lens, query_lens, DEVICE)
    prefixes = prefix_lens[meta.num_decode_tokens:]
    prefixed = max((i + 1 for i, p in enumerate(prefixes) if p > 0), default=0)
    return alloc, dataclasses.replace(meta, prefixed_prefills=prefixed)


# (query_lens, prefix_lens, heads, kv_heads, head_dim, block_size): decodes first
CASES = [
    ([1, 1, 1], [0, 15, 40], 8, 2, 64, 16),  # decode only (first token, mid-block, ratio 4)
    ([7], [0], 4, 4, 64, 8),  # one fresh prompt, ratio 1
    ([1, 1, 12, 5], [9, 31, 0, 8], 8, 1, 64, 8),  # mixed, chunked prefill onto a prefix
    ([1, 20], [63, 4], 16, 2, 128, 16),  # ratio 8, head_dim 128
    # a chunk continuing a prompt, then fresh prompts: two prefill launches where the
    # no-prefix (Gluon) kernel runs
    ([1, 9, 30, 17], [12, 20, 0, 0], 8, 2, 128, 16),
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


@pytest.mark.parametrize(("prefixed", "gluon", "launches"), [
    (1, True, [(1, None), (2, 0)]),  # the continued chunk, then the fresh prompts apart
    (1, False, [(3, None)]),  # no faster kernel for the fresh ones: one launch
    (0, True, [(3, 0)]),  # the header says no sequence has a prefix: one launch at 0
    (3, True, [(3, None)]),  # the last sequence has a prefix: all read the cache
    (None, True, [(3, None)]),  # unknown: as if all had one
])
def test_prefill_launches_split_after_the_last_prefixed_sequence(monkeypatch, prefixed, gluon,
                                                                 launches):
    """Which sequences each prefill launch gets, for the header's count and whether the
    no-prefix kernel runs (float32: the launches themselves take the Triton kernels, which
    read any prefix, so the output matches the torch backend in every case)."""
    from kvpilot.engine.attention import triton_backend

    query_lens, prefix_lens = [1, 9, 30, 17], [12, 20, 0, 0]
    alloc, meta = make_step(query_lens, prefix_lens, 16, seed=3)
    meta = dataclasses.replace(meta, prefixed_prefills=prefixed)
    calls = []
    launcher = triton_backend.paged_prefill_attention

    def spy(*args, **kwargs):
        calls.append((args[6].shape[0], kwargs["max_prefix_len"]))  # (sequences, prefix)
        return launcher(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_prefill_attention", spy)
    monkeypatch.setattr(triton_backend, "no_prefix_kernel_ok", lambda q, k, v: gluon)
    gen = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=DEVICE)

    cache = rand(2, alloc.num_blocks, 16, 2, 64)
    q, k, v = rand(57, 8, 64), rand(57, 2, 64), rand(57, 2, 64)
    want = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.125)
    got = TritonAttentionBackend(num_sms=4).forward(q, k, v, cache, meta, 0.125)
    assert calls == launches
    assert rel_err(got, want) < tolerance(torch.float32)


@pytest.mark.parametrize(("query_lens", "fast", "host"), [
    # decodes, a chunk after a prefix, a fresh prompt: the prefixed launch gets the host's
    # absolute row offsets and sequence lengths
    ([1, 1, 130, 200], True, ([2, 132], [150])),
    ([1, 1, 127, 100], True, (None, None)),  # no sequence has GATHER_MIN_QUERY new tokens
    ([1, 1, 130, 200], False, (None, None)),  # no Gluon kernel: nothing to gather for
])
def test_prefixed_launch_gets_the_host_lengths(monkeypatch, query_lens, fast, host):
    """The launch of sequences with a cached prefix carries host copies of its query offsets
    and sequence lengths (which let the Gluon kernel take it, keys gathered) where a sequence
    is long enough for that and the Gluon kernel runs; the launch without prefixes needs none."""
    from kvpilot.engine.attention import triton_backend

    _, meta = make_step(query_lens, [5, 9, 20, 0], 16, seed=1)
    calls = []
    monkeypatch.setattr(triton_backend, "paged_prefill_attention",
                        lambda *args, **kwargs: calls.append(
                            (kwargs["max_prefix_len"], kwargs["query_start_loc_cpu"],
                             kwargs["seq_lens_cpu"])))
    monkeypatch.setattr(triton_backend, "no_prefix_kernel_ok", lambda q, k, v: fast)
    tokens = sum(query_lens)
    q, k, v = torch.zeros(tokens, 2, 16), torch.zeros(tokens, 1, 16), torch.zeros(tokens, 1, 16)
    out = torch.zeros_like(q)
    TritonAttentionBackend._prefill(q, k, v, torch.zeros(2, 8, 16, 1, 16), meta, 0.25,
                                    (1.0, 1.0), 2, out)
    assert calls[0] == (None, *host)
    if fast:  # the fresh prompt apart, at max_prefix_len 0
        assert calls[1] == (0, None, None)
