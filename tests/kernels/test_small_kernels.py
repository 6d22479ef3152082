"""KV-cache write, fused residual RMSNorm, rotary, SiLU-and-mul and the token bitmask against
their references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import DEVICE, DTYPES, rel_err, tolerance

from kvpilot.kernels.activation import silu_and_mul, silu_and_mul_ref
from kvpilot.kernels.kv_cache_write import kv_cache_write, kv_cache_write_ref
from kvpilot.kernels.rmsnorm import rms_norm, rms_norm_ref
from kvpilot.kernels.rotary import rotary_cos_sin_cache, rotary_embedding, rotary_embedding_ref
from kvpilot.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("slots", "kv_heads", "head_dim", "block_size"), [
    ([0], 1, 64, 8),  # one token
    ([7, 8, 9, -1, 31], 2, 64, 8),  # across a block boundary, one skipped row
    ([-1, -1], 4, 128, 16),  # nothing to write
    ([5, 100, 63], 8, 128, 64),  # ratio-8-sized KV rows, block_size 64
])
def test_kv_cache_write_matches_reference(slots, kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(len(slots) + head_dim)
    num_blocks = 2
    cache = rand(gen, 2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    k, v = (rand(gen, len(slots), kv_heads, head_dim, dtype=dtype) for _ in range(2))
    mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    mapping = torch.where(mapping >= num_blocks * block_size, mapping % (num_blocks * block_size),
                          mapping)
    expected = cache.clone()
    kv_cache_write_ref(k, v, expected, mapping)
    kv_cache_write(k, v, cache, mapping)
    # exact: a copy must not change a single bit, and untouched slots keep their values
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden", "with_residual"), [
    (1, 64, False), (3, 100, True), (5, 1024, True), (2, 48, False),
])
def test_rms_norm_matches_reference(rows, hidden, with_residual, dtype):
    gen = torch.Generator().manual_seed(rows * hidden)
    x, w = rand(gen, rows, hidden, dtype=dtype), rand(gen, hidden, dtype=dtype)
    residual = rand(gen, rows, hidden, dtype=dtype) if with_residual else None
    got = rms_norm(x, w, 1e-6, residual)
    want = rms_norm_ref(x, w, 1e-6, residual)
    if with_residual:
        assert rel_err(got[0], want[0]) < tolerance(dtype)
        assert rel_err(got[1], want[1]) < tolerance(dtype)
    else:
        assert rel_err(got, want) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim", "rotary_dim"), [
    (1, 4, 4, 64, 64), (5, 8, 2, 128, 128), (3, 16, 2, 128, 64), (2, 2, 1, 256, 256),
])
def test_rotary_matches_reference(tokens, heads, kv_heads, head_dim, rotary_dim, is_neox, dtype):
    gen = torch.Generator().manual_seed(tokens * head_dim + heads)
    q, k = rand(gen, tokens, heads, head_dim, dtype=dtype), rand(gen, tokens, kv_heads, head_dim,
                                                                 dtype=dtype)
    cache = rotary_cos_sin_cache(rotary_dim, 4096, device=DEVICE)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
    want_q, want_k = rotary_embedding_ref(positions, q, k, cache, is_neox)
    got_q, got_k = rotary_embedding(positions, q, k, cache, is_neox)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    assert rel_err(got_q, want_q) < tolerance(dtype)
    assert rel_err(got_k, want_k) < tolerance(dtype)


def test_rotary_styles_differ_and_position_zero_is_identity():
    """neox and gpt-j pair different dimensions; position 0 rotates by nothing."""
    gen = torch.Generator().manual_seed(0)
    q, k = rand(gen, 1, 2, 64), rand(gen, 1, 1, 64)
    cache = rotary_cos_sin_cache(64, 16, device=DEVICE)
    at = torch.tensor([5], device=DEVICE)
    neox = rotary_embedding(at, q.clone(), k.clone(), cache, True)[0]
    gptj = rotary_embedding(at, q.clone(), k.clone(), cache, False)[0]
    assert rel_err(neox, gptj) > 0.1
    zero = rotary_embedding(torch.tensor([0], device=DEVICE), q.clone(), k.clone(), cache)[0]
    assert rel_err(zero, q) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(1, 64), (3, 100), (2, 3000)])
def test_silu_and_mul_matches_reference(rows, inter, dtype):
    gen = torch.Generator().manual_seed(rows + inter)
    x = rand(gen, rows, 2 * inter, dtype=dtype)
    assert rel_err(silu_and_mul(x), silu_and_mul_ref(x)) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_a_strided_view(dtype):
    """Qwen3's q/k norm: the heads of a slice of the fused qkv output, normed in place of a
    copy; the input view is left unchanged."""
    gen = torch.Generator().manual_seed(7)
    qkv = rand(gen, 5, (4 + 2 + 2) * 32, dtype=dtype)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    k = qkv[:, 4 * 32: 6 * 32].view(5, 2, 32)
    w = rand(gen, 32, dtype=dtype)
    before = qkv.clone()
    for x in (q, k):
        got = rms_norm(x, w, 1e-6)
        assert got.shape == x.shape
        assert rel_err(got, rms_norm_ref(x, w, 1e-6)) < tolerance(dtype)
    assert torch.equal(qkv, before)


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 4), hidden=st.integers(1, 200))
def test_rms_norm_output_has_unit_rms_when_weight_is_one(rows, hidden):
    """Invariant: with weight 1 and eps 0, every output row has root-mean-square 1."""
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    x = rand(gen, rows, hidden) + 0.1
    out = rms_norm(x, torch.ones(hidden, device=DEVICE), 0.0)
    rms = out.double().pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-4)


@pytest.mark.parametrize(("rows", "size"), [
    (3, 64),  # shorter than a tile: one split works, the others sum nothing
    (2, 2 * 40000),  # several splits, the last one partial, weights wrapping past MODULUS
    (4, 2 * 2049),  # one word past a tile
])
def test_block_checksums_match_the_wire_checksum(rows, size):
    """The KV transfer's per-block sums in one Triton pass equal protocol.checksum's."""
    from kvpilot.engine.contracts.kv_protocol import CHECKSUM_MODULUS, checksum, pack_checksum
    from kvpilot.kernels.block_checksum import block_checksums_triton

    data = torch.randint(0, 256, (rows, size), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(size))
    data[0, :64] = 255  # words of 0xFFFF: the largest products
    sums = block_checksums_triton(data.to(DEVICE), CHECKSUM_MODULUS).cpu().tolist()
    assert [pack_checksum(a, b) for a, b in sums] == [checksum(row.numpy().tobytes())
                                                       for row in data]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "vocab"), [(1, 31), (3, 1000), (5, 2051), (0, 64)])
def test_token_bitmask_matches_reference(rows, vocab, dtype):
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = rand(gen, rows, vocab, dtype=dtype)
    words = torch.randint(-2**31, 2**31 - 1, (rows, -(-vocab // 32)), generator=gen,
                          dtype=torch.int32).to(DEVICE)
    words[:, 0] = -1  # sign bit set, every token of the word allowed
    out = apply_token_bitmask(logits, words)
    assert torch.equal(out, apply_token_bitmask_ref(logits, words))
    assert torch.equal(out.isinf(), apply_token_bitmask_ref(torch.zeros_like(logits),
                                                            words).isinf())
