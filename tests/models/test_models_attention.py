"""The torch paged-attention backend, rope and MoE routing against plain references."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.paged import BlockAllocation
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from kvpilot.engine.models.rope import inverse_frequencies


def reference_attention(q, k, v, query_len, scale):
    """Gives causal GQA attention for one sequence whose last `query_len` rows are queries,
    computed densely with explicit softmax."""
    seq_len, heads, kv_heads = k.shape[0], q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@given(
    seqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=5),
    group=st.sampled_from([1, 2, 4]),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=25, deadline=None)
def test_backend_matches_dense_reference(seqs, group, block_size, seed):
    """Each sequence has `cached` tokens already in the cache and adds `new` this step."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = 2, 8
    heads = kv_heads * group
    seq_lens = [c + n for c, n in seqs]
    query_lens = [min(n, s) for (_, n), s in zip(seqs, seq_lens, strict=True)]
    alloc = BlockAllocation.shuffled(seq_lens, block_size, seed=seed)
    (cache,) = alloc.new_kv_caches(1, kv_heads, head_dim)
    keys = [torch.randn(s, kv_heads, head_dim, generator=gen) for s in seq_lens]
    values = [torch.randn(s, kv_heads, head_dim, generator=gen) for s in seq_lens]
    queries = [torch.randn(q, heads, head_dim, generator=gen) for q in query_lens]
    # earlier steps: write the cached part of every sequence
    cached = [s - q for s, q in zip(seq_lens, query_lens, strict=True)]
    if sum(cached):
        past = alloc.step(cached, cached)
        write_kv_cache(torch.cat([k[:c] for k, c in zip(keys, cached, strict=True)]),
                       torch.cat([v[:c] for v, c in zip(values, cached, strict=True)]),
                       cache, past.slot_mapping)
    meta = alloc.step(seq_lens, query_lens)
    scale = 1 / math.sqrt(head_dim)
    out = TorchAttentionBackend().forward(
        torch.cat(queries),
        torch.cat([k[c:] for k, c in zip(keys, cached, strict=True)]),
        torch.cat([v[c:] for v, c in zip(values, cached, strict=True)]),
        cache, meta, scale)
    expected = torch.cat([reference_attention(q, k, v, len(q), scale)
                          for q, k, v in zip(queries, keys, values, strict=True)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_slot_minus_one_is_not_written():
    cache = torch.zeros(2, 3, 2, 1, 4)
    k, v = torch.ones(3, 1, 4), torch.full((3, 1, 4), 2.0)
    write_kv_cache(k, v, cache, torch.tensor([5, -1, 0]))
    flat = cache.view(2, 6, 1, 4)
    assert flat[0, :, 0, 0].tolist() == [1, 0, 0, 0, 0, 1]
    assert flat[1, :, 0, 0].tolist() == [2, 0, 0, 0, 0, 2]


def test_metadata_without_host_copies_gives_same_output():
    """query_lens_cpu / seq_lens_cpu are an optimisation; the device tensors suffice."""
    gen = torch.Generator().manual_seed(0)
    seq_lens, query_lens = [5, 9, 1], [1, 4, 1]
    alloc = BlockAllocation.shuffled(seq_lens, 4)
    cache = torch.randn(2, alloc.num_blocks, 4, 2, 8, generator=gen)
    meta = alloc.step(seq_lens, query_lens)
    q, k, v = (torch.randn(6, n, 8, generator=gen) for n in (4, 2, 2))
    with_host = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.3)
    meta.query_lens_cpu = meta.seq_lens_cpu = None
    assert torch.equal(TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.3),
                       with_host)


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_inverse_frequencies_match_hf(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 500000.0, **(scaling or {"rope_type": "default"})}
    hf_config = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=params)
    rope_type = params["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    torch.testing.assert_close(inverse_frequencies(128, 500000.0, scaling), expected,
                               rtol=1e-6, atol=0)


def test_unsupported_rope_type_is_a_clear_error():
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type='yarn' in config\.json is "
                                         r"not supported"):
        inverse_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_many_decodes_in_length_groups_match_reference():
    """Enough decode rows to be split into several length groups, interleaved with prefills."""
    gen = torch.Generator().manual_seed(5)
    seq_lens = [*torch.randint(1, 70, (30,), generator=gen).tolist(), 25, 40]
    query_lens = [1] * 30 + [25, 7]
    order = torch.randperm(32, generator=gen).tolist()  # decodes not first, on purpose
    seq_lens, query_lens = [seq_lens[i] for i in order], [query_lens[i] for i in order]
    alloc = BlockAllocation.shuffled(seq_lens, 4)
    cache = torch.randn(2, alloc.num_blocks, 4, 2, 8, generator=gen)
    meta = alloc.step(seq_lens, query_lens)
    q = torch.randn(sum(query_lens), 4, 8, generator=gen)
    k, v = (torch.randn(sum(query_lens), 2, 8, generator=gen) for _ in range(2))
    out = TorchAttentionBackend().forward(q, k, v, cache, meta, 0.3)
    start = 0
    for i, (s, n) in enumerate(zip(seq_lens, query_lens, strict=True)):
        blocks = alloc.block_tables[i, : -(-s // 4)].long()
        ctx_k, ctx_v = (cache[j, blocks].flatten(0, 1)[:s] for j in (0, 1))
        expected = reference_attention(q[start:start + n], ctx_k, ctx_v, n, 0.3)
        torch.testing.assert_close(out[start:start + n], expected, rtol=1e-5, atol=1e-5)
        start += n
