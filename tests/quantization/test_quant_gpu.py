"""8-bit weights and the fp8 KV cache on a real GPU (skipped without CUDA; fp8 needs
compute capability 8.9+): `torch._scaled_mm` against the float32 reference, the Triton
kernels over an fp8 cache against their torch references, and the engine end to end."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.paged import BlockAllocation

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.entrypoints.llm import LLM
from kvpilot.engine.quantization.methods import METHODS, fp8_matmul_ref, quantize_per_token
from kvpilot.kernels.kv_cache_write import kv_cache_write, kv_cache_write_ref
from kvpilot.kernels.paged_decode_attention import (
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kvpilot.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

ON_FP8_GPU = (os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.is_available()
              and torch.cuda.get_device_capability() >= (8, 9))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not ON_FP8_GPU, reason="needs a CUDA GPU of compute capability 8.9+ and compiled Triton")]
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
KV_SCALES = (0.05, 0.25)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize(("tokens", "in_features", "out_features"),
                         [(65, 4096, 6144), (100, 4096, 28672), (512, 14336, 4096)])
def test_scaled_mm_matches_reference(tokens, in_features, out_features):
    gen = torch.Generator().manual_seed(tokens)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.02).to(BF16).cuda()
    x = torch.randn(tokens, in_features, generator=gen).to(BF16).cuda()
    fp8 = METHODS["fp8"]
    q, scale = fp8.quantize(weight)
    got = fp8.matmul(x, q, scale)
    x_q, x_scale = quantize_per_token(x)
    want = fp8_matmul_ref(x_q, x_scale, q, scale)
    assert got.dtype == BF16 and rel_err(got, want) < 1e-2  # bf16 output rounding
    assert rel_err(got, x @ weight.t()) < 0.1  # and near the bf16 layer


@pytest.mark.parametrize("tokens", [1, 8, 64, 65, 300])  # the Triton GEMM up to 64 rows
@pytest.mark.parametrize(("method", "near_bf16"), [("int8", 0.03), ("fp8", 0.1)])
def test_weight_only_on_gpu(tokens, method, near_bf16):
    """int8 at every size, and fp8 at decode sizes (<= 64 rows, the Triton GEMM), multiply
    the widened 8-bit weight with unrounded activations."""
    gen = torch.Generator().manual_seed(tokens)
    weight = (torch.randn(6144, 4096, generator=gen) * 0.02).to(BF16).cuda()
    x = torch.randn(tokens, 4096, generator=gen).to(BF16).cuda()
    q, scale = METHODS[method].quantize(weight)
    got = METHODS[method].matmul(x, q, scale)
    if method == "int8" or tokens <= 64:
        assert rel_err(got, (x.float() @ (q.float() * scale[:, None]).t())) < 1e-2
    assert rel_err(got, x @ weight.t()) < near_bf16


@pytest.mark.parametrize(("seqs", "heads", "kv_heads", "head_dim"), [
    ([(3000, 1), (1, 1), (700, 1), (0, 900), (129, 77)], 32, 8, 128),
    ([(16, 1), (0, 513), (1000, 64)], 16, 16, 64),
])
def test_fp8_cache_kernels_match_references(seqs, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads)
    seq_lens = [c + n for c, n in seqs]
    query_lens = [n for _, n in seqs]
    alloc = BlockAllocation.shuffled(seq_lens, 16)
    (cache,) = alloc.new_kv_caches(1, kv_heads, head_dim, FP8)
    cache = cache.cuda()
    ref_cache = cache.clone()
    # write every token's K/V through the kernel and through the reference
    k_all, v_all = (torch.randn(sum(seq_lens), kv_heads, head_dim, generator=gen).to(BF16).cuda()
                    for _ in range(2))
    every = alloc.step(seq_lens, seq_lens, "cuda")
    kv_cache_write(k_all, v_all, cache, every.slot_mapping, KV_SCALES)
    kv_cache_write_ref(k_all, v_all, ref_cache, every.slot_mapping, KV_SCALES)
    # Triton's fp32 division may differ from torch's in the last bit: a rare value lands
    # one E4M3 step away
    differ = cache.view(torch.uint8) != ref_cache.view(torch.uint8)
    assert differ.float().mean().item() < 1e-3
    a, b = cache.float()[differ], ref_cache.float()[differ]
    assert ((a - b).abs() <= b.abs() / 8 + 2**-9).all()
    meta = alloc.step(seq_lens, query_lens, "cuda")
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(BF16).cuda()
    rows = torch.cat([torch.arange(s - n, s) + sum(seq_lens[:i])
                      for i, (s, n) in enumerate(zip(seq_lens, query_lens, strict=True))])
    k, v = k_all[rows.cuda()], v_all[rows.cuda()]
    scale = head_dim ** -0.5
    d = meta.num_decode_tokens
    out = torch.full_like(q, float("nan"))
    splits = default_num_splits(d, kv_heads, max(seq_lens))
    paged_decode_attention(q[:d], cache, meta.block_tables[:d], meta.seq_lens[:d], scale,
                           splits, out=out[:d], kv_scales=KV_SCALES)
    paged_prefill_attention(q, k, v, cache, meta.block_tables[d:], meta.query_start_loc[d:],
                            meta.seq_lens[d:], meta.max_query_len, scale, out=out,
                            kv_scales=KV_SCALES)
    want_decode = paged_decode_attention_ref(q[:d], cache, meta.block_tables[:d],
                                             meta.seq_lens[:d], scale, KV_SCALES)
    want_prefill = paged_prefill_attention_ref(q, k, v, cache, meta.block_tables[d:],
                                               meta.query_start_loc[d:], meta.seq_lens[d:],
                                               scale, KV_SCALES)
    assert rel_err(out[:d], want_decode) < 2e-2  # bf16 q and dequantised K/V in the dots
    assert rel_err(out[d:], want_prefill[d:]) < 2e-2


@pytest.mark.parametrize(("quantization", "kv_cache_dtype"),
                         [("int8", "auto"), ("fp8", "auto"), ("fp8", "fp8"), ("none", "fp8")])
def test_engine_serves_8bit_on_gpu(quantization, kv_cache_dtype, tiny_checkpoints):
    """Triton attention, CUDA graphs and async scheduling with 8-bit weights / KV: greedy
    tokens agree with bf16 (printed). The floors are not accuracy bounds (those are the logits
    errors of test_quant_accuracy.py and the kernels' tests above): on this random-weight
    checkpoint the logits are nearly flat, so E4M3's 3-bit mantissa flips greedy picks (fp8
    agreed 0.52-0.77 on an H100); a broken path agrees ~1/vocab."""
    path = str(tiny_checkpoints("llama"))
    prompts = [[*range(10, 40), *range(i, i + 20)] for i in range(100, 900, 100)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    flags = dict(device="cuda", dtype="bfloat16", num_kv_blocks=128)
    want = [o.outputs[0].token_ids for o in LLM(path, **flags).generate(prompts, greedy)]
    llm = LLM(path, quantization=quantization, kv_cache_dtype=kv_cache_dtype, **flags)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    pairs = [(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    print(f"{quantization} weights, {kv_cache_dtype} KV: greedy agreement {agreement:.3f}")
    assert agreement >= (0.9 if quantization == "int8" else 0.5)
    assert llm.get_stats().graph_steps > 0
