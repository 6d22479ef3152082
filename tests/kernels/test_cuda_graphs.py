"""CUDA-graph buckets (CPU) and the GPU engine path: Triton + graphs against the torch backend."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from kernel_testing import ON_GPU
from kvpilot.engine.cuda_graphs import batch_buckets
from kvpilot.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(("max_num_seqs", "expected"), [
    (1, [1]),
    (3, [1, 2, 3]),
    (8, [1, 2, 4, 8]),
    (20, [1, 2, 4, 8, 16, 20]),
    (32, [1, 2, 4, 8, 16, 24, 32]),
])
def test_batch_buckets(max_num_seqs, expected):
    assert batch_buckets(max_num_seqs) == expected


@pytest.mark.parametrize("max_num_seqs", [1, 7, 64, 256, 257])
def test_every_batch_size_has_a_bucket_with_bounded_padding(max_num_seqs):
    buckets = batch_buckets(max_num_seqs)
    for n in range(1, max_num_seqs + 1):
        size = next(b for b in buckets if b >= n)
        assert size - n < 8  # at most 7 padding rows


def first_divergence_ok(ref, got) -> tuple[bool, bool]:
    """Gives (exact, acceptable): where greedy tokens first differ, each side's token must be
    in the other's top-5 at that step (a bf16 near-tie flipped); after it they may differ."""
    ref_ids, got_ids = ref.outputs[0].token_ids, got.outputs[0].token_ids
    for i, (a, b) in enumerate(zip(ref_ids, got_ids, strict=True)):
        if a != b:
            top_ref, top_got = ref.outputs[0].logprobs[i], got.outputs[0].logprobs[i]
            return False, b in top_ref and a in top_got
    return True, True


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with compiled Triton")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_triton_engine_greedy_matches_torch_backend(model):
    from kvpilot.engine.llm import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1024) for _ in range(n)] for n in (1, 7, 16, 17, 100, 300, 33, 2)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5)
    common = {"device": "cuda", "num_kv_blocks": 256, "max_num_seqs": 8, "block_size": 16}
    runs = {}
    for name, flags in [("torch", {"attention_backend": "torch", "enforce_eager": True}),
                        ("triton-eager", {"attention_backend": "triton", "enforce_eager": True}),
                        ("triton-graphs", {"attention_backend": "triton"})]:
        llm = LLM(model, **common, **flags)
        assert llm.engine.model_config.dtype == torch.bfloat16  # auto dtype on GPU
        runs[name] = llm.generate(prompts, params)
        graphs = llm.engine.runner.decode_graphs
        if name == "triton-graphs":
            assert graphs is not None and graphs.num_replays > 0
        else:
            assert graphs is None
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    # graphs pad the batch, which may change split counts and GEMM tiles: the same rule
    for ref, name in (("torch", "triton-eager"), ("torch", "triton-graphs"),
                      ("triton-eager", "triton-graphs")):
        verdicts = [first_divergence_ok(r, g) for r, g in zip(runs[ref], runs[name],
                                                                strict=True)]
        assert all(ok for _, ok in verdicts), (ref, name, verdicts)
        assert sum(exact for exact, _ in verdicts) >= len(prompts) // 2, (ref, name, verdicts)
