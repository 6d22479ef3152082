"""--kv-cache-dtype fp8 on CPU (float8_e4m3fn storage works in CPU torch; rows move as bytes).

Documented error: attention over an fp8 (E4M3) cache stays within 6% of max |output| of
the float32-cache attention (E4M3 keeps 3 mantissa bits: 2^-4 relative rounding per K/V
element, averaged by the softmax); the kernels' torch references read the same cache to
float32 rounding, so the GPU kernel tests (test_kv_cache_fp8_gpu in test_quant_gpu.py)
hold the Triton kernels to them. The engine's pool holds twice the blocks of a bf16
cache in the same memory, and greedy tokens mostly agree (printed, bounded).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.paged import BlockAllocation

from kvpilot.engine.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.entrypoints.llm import LLM
from kvpilot.kernels.paged_decode_attention import paged_decode_attention_ref
from kvpilot.kernels.paged_prefill_attention import paged_prefill_attention_ref

MAX_REL_ERR = 0.06
KV_HEADS, GROUP, HEAD_DIM = 2, 2, 16


def attend(cache_dtype: torch.dtype, kv_scales: tuple[float, float], seqs, seed: int = 0):
    """Gives (output, q, k, v, cache, meta) of one step where sequence i has seqs[i] =
    (cached, new) tokens, the cached ones written by an earlier step."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in seqs]
    query_lens = [n for _, n in seqs]
    alloc = BlockAllocation.shuffled(seq_lens, 4, seed=seed)
    (cache,) = alloc.new_kv_caches(1, KV_HEADS, HEAD_DIM, cache_dtype)
    keys = torch.randn(sum(seq_lens), KV_HEADS, HEAD_DIM, generator=gen)
    values = torch.randn(sum(seq_lens), KV_HEADS, HEAD_DIM, generator=gen)
    bounds = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    past = [slice(bounds[i], bounds[i] + c) for i, (c, _) in enumerate(seqs)]
    new = [slice(bounds[i] + c, bounds[i + 1]) for i, (c, _) in enumerate(seqs)]
    cached = [c for c, _ in seqs]
    if sum(cached):
        step = alloc.step(cached, cached)
        write_kv_cache(torch.cat([keys[s] for s in past]), torch.cat([values[s] for s in past]),
                       cache, step.slot_mapping, kv_scales)
    meta = alloc.step(seq_lens, query_lens)
    q = torch.randn(sum(query_lens), KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    k, v = torch.cat([keys[s] for s in new]), torch.cat([values[s] for s in new])
    out = TorchAttentionBackend().forward(q, k, v, cache, meta, 1 / math.sqrt(HEAD_DIM),
                                          kv_scales)
    return out, q, k, v, cache, meta


# (cached, new) tokens per sequence: decodes first (as the runner orders them), then
# prefill chunks with and without a cached prefix
STEPS = [[(30, 1), (7, 1), (0, 1)], [(0, 23), (12, 9)], [(40, 1), (16, 20), (0, 5)]]


@pytest.mark.parametrize("seqs", STEPS)
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.05, 0.25)])
def test_fp8_cache_attention_within_documented_error(seqs, kv_scales):
    want = attend(torch.float32, kv_scales, seqs)[0]
    got, q, k, v, cache, meta = attend(torch.float8_e4m3fn, kv_scales, seqs)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"fp8 KV {seqs} scales {kv_scales}: max relative error {rel:.4f}")
    assert 0 < rel <= MAX_REL_ERR
    # the kernels' references read the same fp8 cache to float32 rounding
    scale = 1 / math.sqrt(HEAD_DIM)
    decodes = meta.num_decode_tokens
    if decodes:
        ref = paged_decode_attention_ref(q[:decodes], cache, meta.block_tables[:decodes],
                                         meta.seq_lens[:decodes], scale, kv_scales)
        torch.testing.assert_close(got[:decodes], ref, rtol=1e-5, atol=1e-5)
    if decodes < q.shape[0]:
        ref = paged_prefill_attention_ref(q, k, v, cache, meta.block_tables[decodes:],
                                          meta.query_start_loc[decodes:],
                                          meta.seq_lens[decodes:], scale, kv_scales)
        torch.testing.assert_close(got[decodes:], ref[decodes:], rtol=1e-5, atol=1e-5)


def test_fp8_cache_saturates_instead_of_overflowing():
    cache = torch.zeros(2, 1, 4, 1, 2, dtype=torch.float8_e4m3fn)
    big = torch.tensor([[[1000.0, -1000.0]]])
    write_kv_cache(big, big, cache, torch.tensor([2]), (1.0, 4.0))
    assert cache[0, 0, 2, 0].float().tolist() == [448.0, -448.0]  # saturated, not inf/NaN
    assert cache[1, 0, 2, 0].float().tolist() == [256.0, -256.0]  # 1000 / 4, to E4M3


def test_engine_holds_twice_the_tokens_and_agrees(tiny_checkpoints):
    """Same memory budget, bf16 model: the fp8 pool has exactly twice the blocks. Prefix
    caching, chunked prefill and preemption all run over fp8 blocks (byte copies)."""
    path = str(tiny_checkpoints("llama"))
    # 2 layers x 2 (K, V) x 16 slots x 2 KV heads x 16 dims x 2 B (bf16)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 2
    flags = dict(dtype="bfloat16", kv_cache_memory=str(6 * block_bytes),
                 max_num_batched_tokens=32)
    # 6 prompts of 40 tokens behind one shared block: 4 blocks each with their outputs,
    # 19 in all, more than even the fp8 pool's 12
    prompts = [[*range(10, 26), *range(i, i + 24)] for i in range(100, 700, 100)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs, stats = {}, {}
    for kv in ("auto", "fp8"):
        llm = LLM(path, kv_cache_dtype=kv, **flags)
        outputs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        stats[kv] = llm.get_stats()
    assert (stats["auto"].num_total_blocks, stats["fp8"].num_total_blocks) == (6, 12)
    assert stats["fp8"].prefix_cache_hits > 0 and stats["fp8"].num_preemptions > 0
    pairs = [(a, b) for g, w in zip(outputs["fp8"], outputs["auto"], strict=True)
             for a, b in zip(g, w, strict=True)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    print(f"fp8 KV greedy token agreement with bf16 KV: {agreement:.3f}")
    assert agreement >= 0.7
