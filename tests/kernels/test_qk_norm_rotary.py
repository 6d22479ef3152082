"""Qwen3's fused q/k RMSNorm + rotary against its reference and against the unfused kernels
(rms_norm on q and on k, then rotary_embedding), whose bits it must reproduce."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernel_testing import DEVICE, DTYPES, ON_GPU, rel_err, tolerance

from kvpilot.kernels.kv_cache_dtype import FP8_KV_DTYPE, as_bytes
from kvpilot.kernels.kv_cache_write import kv_cache_write
from kvpilot.kernels.qk_norm_rotary import (
    matches_unfused_bits,
    qk_norm_rotary,
    qk_norm_rotary_ref,
    rotary_kv_write,
    supports_qk_norm_rotary,
)
from kvpilot.kernels.rmsnorm import rms_norm
from kvpilot.kernels.rotary import rotary_cos_sin_cache, rotary_embedding

EPS = 1e-6


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def qkv_views(gen, tokens, heads, kv_heads, head_dim, dtype):
    """Gives (qkv, q, k): q and k as strided [T, heads, d] views of one fused qkv output."""
    qkv = rand(gen, tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype) * 3
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    return qkv, q, k


@dataclass
class CacheCase:
    """q/k/v as views of one qkv buffer; a rotary table, positions and slots (two of them -1);
    a filled cache twice (`want` for the unfused kernels, `got` for the fused one); and
    plain copies of q/k/v for the unfused kernels."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rope: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    scales: tuple[float, float]
    want_cache: torch.Tensor
    got_cache: torch.Tensor
    pq: torch.Tensor
    pk: torch.Tensor
    pv: torch.Tensor


def cache_case(gen, rotary_dim, dtype, fp8, heads=4, kv_heads=2, head_dim=128) -> CacheCase:
    tokens, block_size, blocks = 6, 4, 5
    qkv, q, k = qkv_views(gen, tokens, heads, kv_heads, head_dim, dtype)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    rope = rotary_cos_sin_cache(rotary_dim, 64, device=DEVICE)
    positions = torch.randperm(64, generator=gen)[:tokens].to(DEVICE)
    slots = torch.tensor([7, -1, 0, 19, -1, 12], device=DEVICE)
    cache_dtype, scales = (FP8_KV_DTYPE, (0.05, 0.02)) if fp8 else (dtype, (1.0, 1.0))
    fill = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen)
    want_cache = fill.to(DEVICE).to(cache_dtype)
    plain = qkv.clone()
    pq, pk = plain[:, :heads * head_dim].view_as(q), \
        plain[:, heads * head_dim:(heads + kv_heads) * head_dim].view_as(k)
    pv = plain[:, (heads + kv_heads) * head_dim:].view_as(v)
    return CacheCase(q, k, v, rope, positions, slots, scales, want_cache, want_cache.clone(),
                     pq, pk, pv)


def unfused(positions, q, k, q_weight, k_weight, cache, is_neox):
    """The three kernels the fused one replaces, as the model ran them."""
    qn, kn = rms_norm(q, q_weight, EPS), rms_norm(k, k_weight, EPS)
    assert isinstance(qn, torch.Tensor) and isinstance(kn, torch.Tensor)
    return rotary_embedding(positions, qn, kn, cache, is_neox)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim", "rotary_dim"), [
    (1, 4, 2, 64, 64),  # one decode token
    (5, 8, 2, 128, 128),  # Qwen3's head_dim
    (3, 4, 4, 128, 64),  # partial rotary: dims 64.. only normed
    (4, 2, 1, 64, 16),  # a quarter rotated
    # head counts that are not powers of two; past 16 tokens two heads a program (9 heads: the
    # last program's second is past the end)
    (17, 6, 3, 64, 64),
    (2, 2, 1, 256, 256),  # two elements a thread
    (3, 4, 2, 32, 32),  # one warp's row: on a GPU near rms_norm's bits, not on them
])
def test_matches_reference_and_unfused_kernels(tokens, heads, kv_heads, head_dim, rotary_dim,
                                               is_neox, dtype):
    gen = torch.Generator().manual_seed(tokens * head_dim + heads + rotary_dim)
    qkv, q, k = qkv_views(gen, tokens, heads, kv_heads, head_dim, dtype)
    q_weight, k_weight = rand(gen, head_dim, dtype=dtype), rand(gen, head_dim, dtype=dtype)
    cache = rotary_cos_sin_cache(rotary_dim, 4096, device=DEVICE)
    positions = torch.randperm(4096, generator=gen)[:tokens].to(DEVICE)  # not in order
    want_q, want_k = qk_norm_rotary_ref(positions, q, k, q_weight, k_weight, EPS, cache,
                                        is_neox)
    before = qkv.clone()
    same_q, same_k = unfused(positions, q, k, q_weight, k_weight, cache, is_neox)
    assert torch.equal(qkv, before)  # the unfused chain reads q and k without writing them

    got_q, got_k = qk_norm_rotary(positions, q, k, q_weight, k_weight, EPS, cache, is_neox)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    assert rel_err(got_q, want_q) < tolerance(dtype)
    assert rel_err(got_k, want_k) < tolerance(dtype)
    # bit for bit what the three kernels give (see matches_unfused_bits), and v (the rest of
    # the row) untouched
    if matches_unfused_bits(head_dim) or not ON_GPU:
        assert torch.equal(got_q, same_q) and torch.equal(got_k, same_k)
    else:
        assert rel_err(got_q, same_q) < tolerance(dtype)
    v_cols = (heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, v_cols:], before[:, v_cols:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rotary_dim", "fp8", "heads_per_program"), [
    (128, False, 1), (128, True, 3), (64, False, 3), (64, True, 1)])
def test_writing_the_kv_cache_gives_what_kv_cache_write_gives(rotary_dim, dtype, fp8,
                                                             heads_per_program):
    """With the cache, the kernel also stores the finished k rows and the v rows in their
    slots (none for slot -1), the same bits as kv_cache_write after the unfused kernel;
    q and k come out as they do without it."""
    gen = torch.Generator().manual_seed(rotary_dim + fp8)
    c = cache_case(gen, rotary_dim, dtype, fp8)
    q_weight, k_weight = rand(gen, 128, dtype=dtype), rand(gen, 128, dtype=dtype)
    qk_norm_rotary(c.positions, c.pq, c.pk, q_weight, k_weight, EPS, c.rope)
    kv_cache_write(c.pk, c.pv, c.want_cache, c.slots, c.scales)

    got_q, got_k = qk_norm_rotary(c.positions, c.q, c.k, q_weight, k_weight, EPS, c.rope, v=c.v,
                                  kv_cache=c.got_cache, slot_mapping=c.slots,
                                  kv_scales=c.scales, heads_per_program=heads_per_program)
    assert torch.equal(got_q, c.pq) and torch.equal(got_k, c.pk)
    assert torch.equal(as_bytes(c.got_cache), as_bytes(c.want_cache))


@pytest.mark.parametrize(("rotary_dim", "dtype", "fp8", "heads_per_program"), [
    (128, DTYPES[0], False, 1), (64, DTYPES[-1], False, 3), (128, DTYPES[-1], True, 2),
    (32, DTYPES[0], True, 1),
])
def test_rotary_kv_write_gives_rotary_then_kv_cache_write(rotary_dim, dtype, fp8,
                                                          heads_per_program):
    """Without norms (Llama): rotary_embedding then kv_cache_write, the same bits, partial
    rotary's tail cached as it is."""
    gen = torch.Generator().manual_seed(rotary_dim + fp8)
    c = cache_case(gen, rotary_dim, dtype, fp8)
    rotary_embedding(c.positions, c.pq, c.pk, c.rope)
    kv_cache_write(c.pk, c.pv, c.want_cache, c.slots, c.scales)

    got_q, got_k = rotary_kv_write(c.positions, c.q, c.k, c.rope, c.v, c.got_cache, c.slots,
                                   c.scales, heads_per_program=heads_per_program)
    assert torch.equal(got_q, c.pq) and torch.equal(got_k, c.pk)
    assert torch.equal(as_bytes(c.got_cache), as_bytes(c.want_cache))


def test_refuses_a_cache_write_without_its_pieces():
    gen = torch.Generator().manual_seed(0)
    _, q, k = qkv_views(gen, 2, 4, 2, 64, torch.float32)
    w = torch.ones(64, device=DEVICE)
    rope = rotary_cos_sin_cache(64, 8, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    cache = torch.zeros(2, 3, 4, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_norm_rotary(positions, q, k, w, w, EPS, rope, v=k.clone(), kv_cache=cache)
    with pytest.raises(ValueError, match="kv_cache"):
        qk_norm_rotary(positions, q, k, w, w, EPS, rope, v=k.clone(), kv_cache=cache[:, :, :, :1],
                       slot_mapping=torch.zeros(2, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_leaves_the_tail_normed_but_unrotated(dtype):
    gen = torch.Generator().manual_seed(3)
    _, q, k = qkv_views(gen, 3, 2, 1, 64, dtype)
    w = rand(gen, 64, dtype=dtype)
    normed_q = rms_norm(q, w, EPS)
    assert isinstance(normed_q, torch.Tensor)
    cache = rotary_cos_sin_cache(32, 64, device=DEVICE)
    positions = torch.tensor([5, 0, 17], device=DEVICE)
    got_q, _ = qk_norm_rotary(positions, q, k, w, w, EPS, cache)
    assert torch.equal(got_q[..., 32:], normed_q[..., 32:])
    assert torch.equal(got_q[1], normed_q[1])  # position 0 rotates by nothing
    assert not torch.equal(got_q[0, :, :32], normed_q[0, :, :32])


def test_weights_and_heads_are_kept_apart():
    """q heads take q_weight, k heads k_weight; swapping the weights changes both."""
    gen = torch.Generator().manual_seed(11)
    _, q, k = qkv_views(gen, 2, 4, 2, 32, torch.float32)
    qw, kw = rand(gen, 32), rand(gen, 32)
    cache = rotary_cos_sin_cache(32, 16, device=DEVICE)
    positions = torch.tensor([3, 9], device=DEVICE)
    a = qk_norm_rotary(positions, q.clone(), k.clone(), qw, kw, EPS, cache)
    b = qk_norm_rotary(positions, q.clone(), k.clone(), kw, qw, EPS, cache)
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])


def test_no_tokens_is_a_no_op():
    q = torch.empty(0, 4, 32, device=DEVICE)
    k = torch.empty(0, 2, 32, device=DEVICE)
    w = torch.ones(32, device=DEVICE)
    cache = rotary_cos_sin_cache(32, 16, device=DEVICE)
    got_q, got_k = qk_norm_rotary(torch.empty(0, dtype=torch.long, device=DEVICE), q, k, w, w,
                                  EPS, cache)
    assert got_q.shape == q.shape and got_k.shape == k.shape


@pytest.mark.parametrize(("head_dim", "rotary_dim", "ok"), [
    (128, 128, True), (128, 64, True), (64, 16, True),
    (96, 96, False),  # head_dim not a power of two
    (128, 96, False),  # rotary half 48
    (64, 128, False),  # more rotary dims than head dims
    (64, 0, False),
])
def test_supports(head_dim, rotary_dim, ok):
    assert supports_qk_norm_rotary(head_dim, rotary_dim) == ok


def test_only_rows_longer_than_a_warp_match_the_unfused_bits():
    assert [matches_unfused_bits(d) for d in (16, 32, 64, 128, 256)] == [
        False, False, True, True, True]


def test_refuses_shapes_it_cannot_handle():
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    q, k = torch.zeros(2, 4, 96, device=DEVICE), torch.zeros(2, 2, 96, device=DEVICE)
    w = torch.ones(96, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        qk_norm_rotary(positions, q, k, w, w, EPS, rotary_cos_sin_cache(96, 8, device=DEVICE))
    q, k = torch.zeros(2, 4, 64, device=DEVICE), torch.zeros(2, 2, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        qk_norm_rotary(positions, q, k, w, w, EPS, rotary_cos_sin_cache(48, 8, device=DEVICE))
    cache = rotary_cos_sin_cache(64, 8, device=DEVICE)
    with pytest.raises(ValueError, match="q_weight"):
        qk_norm_rotary(positions, q, k, torch.ones(32, device=DEVICE), w, EPS, cache)
    with pytest.raises(ValueError, match="k_weight"):
        qk_norm_rotary(positions, q, k, w, w.half(), EPS, cache)
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rotary(positions[:1], q, k, w, w, EPS, cache)
    with pytest.raises(ValueError, match="contiguous head_dim"):
        qk_norm_rotary(positions, torch.zeros(2, 4, 128, device=DEVICE)[..., ::2], k, w, w, EPS,
                       cache)
