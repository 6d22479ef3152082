"""The kernels at serving sizes in bfloat16 on a real GPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import ON_GPU, rel_err, tolerance
from paged_fixtures import random_paged_cache

from kvpilot.kernels.activation import silu_and_mul, silu_and_mul_ref
from kvpilot.kernels.paged_decode_attention import (
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kvpilot.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from kvpilot.kernels.rmsnorm import rms_norm, rms_norm_ref
from kvpilot.kernels.rotary import rotary_cos_sin_cache, rotary_embedding, rotary_embedding_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with compiled (not interpreted) Triton"),
]
BF16 = torch.bfloat16


@pytest.mark.parametrize(("batch", "heads", "kv_heads", "head_dim", "block_size", "max_len"), [
    (16, 32, 8, 128, 16, 3000),  # Llama-3-8B-like, ratio 4
    (5, 16, 16, 64, 8, 700),  # ratio 1
    (3, 64, 8, 128, 32, 2049),  # ratio 8
    (4, 8, 2, 256, 64, 1000),  # head_dim 256
])
def test_decode_bf16(batch, heads, kv_heads, head_dim, block_size, max_len):
    gen = torch.Generator().manual_seed(batch * heads)
    lens = [1, max_len, *torch.randint(1, max_len, (batch - 2,), generator=gen).tolist()]
    cache, tables = random_paged_cache(lens, kv_heads, head_dim, block_size, BF16, "cuda", gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(BF16).cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    splits = default_num_splits(batch, kv_heads, max_len)
    paged_decode_attention(q, cache, tables, seq_lens, head_dim**-0.5, splits, out=out)
    ref = paged_decode_attention_ref(q, cache, tables, seq_lens, head_dim**-0.5)
    assert rel_err(out, ref) < tolerance(BF16)


@pytest.mark.parametrize(("query_lens", "prefix_lens", "heads", "kv_heads", "head_dim"), [
    ([1000, 1, 77, 300], [0, 500, 129, 16], 32, 8, 128),
    ([513, 64], [0, 1000], 16, 16, 64),
    ([200, 3], [35, 0], 8, 1, 256),
])
def test_prefill_bf16(query_lens, prefix_lens, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(sum(query_lens))
    seq_lens = [q + p for q, p in zip(query_lens, prefix_lens, strict=True)]
    cache, tables = random_paged_cache(seq_lens, kv_heads, head_dim, 16, BF16, "cuda", gen)
    total = sum(query_lens)
    q, k, v = (torch.randn(total, n, head_dim, generator=gen).to(BF16).cuda()
               for n in (heads, kv_heads, kv_heads))
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k, v, cache, tables, starts, lens, max(query_lens),
                            head_dim**-0.5, out=out)
    ref = paged_prefill_attention_ref(q, k, v, cache, tables, starts, lens, head_dim**-0.5)
    assert rel_err(out, ref) < tolerance(BF16)


def test_small_kernels_bf16():
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(300, 4096, generator=gen).to(BF16).cuda() for _ in range(2))
    w = torch.randn(4096, generator=gen).to(BF16).cuda()
    out, res = rms_norm(x, w, 1e-6, r)
    want_out, want_res = rms_norm_ref(x, w, 1e-6, r)
    assert torch.equal(res, want_res)
    assert rel_err(out, want_out) < 1e-2  # rsqrt differs in the last bit at most
    gu = torch.randn(300, 2 * 14336, generator=gen).to(BF16).cuda()
    assert rel_err(silu_and_mul(gu), silu_and_mul_ref(gu)) < tolerance(BF16)
    cos_sin = rotary_cos_sin_cache(128, 8192, device="cuda")
    positions = torch.randint(0, 8192, (300,), generator=gen).cuda()
    q, k = torch.randn(300, 32, 128).to(BF16).cuda(), torch.randn(300, 8, 128).to(BF16).cuda()
    want_q, want_k = rotary_embedding_ref(positions, q, k, cos_sin)
    rotary_embedding(positions, q, k, cos_sin)
    assert rel_err(q, want_q) < tolerance(BF16)
    assert rel_err(k, want_k) < tolerance(BF16)
