"""CUDA-graph buckets (CPU) and the GPU engine path: Triton + graphs against the torch backend."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from kernel_testing import ON_GPU

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.worker.cuda_graphs import batch_buckets


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
    from kvpilot.engine.entrypoints.llm import LLM

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


class EagerGraph:
    """Stands in for a captured CUDA graph on CPU: replay re-runs the forward it recorded."""

    def __init__(self, run) -> None:
        self.run = run

    def replay(self) -> None:
        self.run()


@pytest.mark.parametrize(("seq_lens", "bucket_of"), [([5], 1), ([9, 17, 3], 4), ([40] * 5, 8)])
def test_replay_pads_the_batch_and_matches_eager(seq_lens, bucket_of):
    """The static-buffer plumbing on CPU: inputs copied in, padding rows neither write the
    cache nor change the real rows, and the real rows equal an eager forward."""
    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.models.config import ModelConfig
    from kvpilot.engine.models.loader import load_model
    from kvpilot.engine.worker.cuda_graphs import DecodeGraphs

    args = EngineArgs(model="tiny-llama", max_model_len=64)
    config = ModelConfig.from_engine_args(args, torch.device("cpu"))
    model = load_model(config, "dummy", "cpu")
    block_size, num_blocks, width = 8, 64, 8
    shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    gen = torch.Generator().manual_seed(len(seq_lens))
    caches = [torch.randn(shape, generator=gen) for _ in range(config.num_layers)]
    graphs = DecodeGraphs(model, caches, max_num_seqs=8, max_blocks_per_seq=width,
                          max_model_len=64, device=torch.device("cpu"))
    for size in graphs.buckets:  # "capture" by recording the call, as the graph would
        args_ = (graphs.input_ids[:size], graphs.positions[:size], caches, graphs._meta(size))
        graphs.outputs[size] = model(*args_).clone()
        graphs.graphs[size] = EagerGraph(
            lambda size=size, a=args_: graphs.outputs[size].copy_(model(*a)))
    n = len(seq_lens)
    tables = torch.randperm(num_blocks, generator=gen)[: n * width].view(n, width).int()
    positions = torch.tensor([s - 1 for s in seq_lens])
    slots = tables[torch.arange(n), positions // block_size].long() * block_size + (
        positions % block_size)
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        max_query_len=1, max_seq_len=max(seq_lens), num_decode_tokens=n)
    ids = torch.randint(5, 1000, (n,), generator=gen)
    assert graphs.can_replay(meta, caches)
    assert not graphs.can_replay(meta, [c.clone() for c in caches])  # other caches: eager
    eager_caches = [c.clone() for c in caches]
    before = [c.clone() for c in caches]
    want = model(ids, positions, eager_caches, meta)
    # stale state of an earlier, larger step: replay must reset the padding rows
    spare = int(torch.tensor([b for b in range(num_blocks) if b not in tables])[0]) * block_size
    graphs.slot_mapping.fill_(spare)
    graphs.seq_lens.fill_(5)
    got = graphs.replay(ids, positions, meta)
    assert got.shape[0] == n
    assert next(b for b in graphs.buckets if b >= n) == bucket_of
    torch.testing.assert_close(got, want)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    for cache, eager, old in zip(caches, eager_caches, before, strict=True):
        flat, flat_old = cache.flatten(1, 2), old.flatten(1, 2)
        # padding rows wrote nothing; real rows match eager up to GEMM rounding, which
        # depends on the (padded) batch size
        assert torch.equal(flat[:, untouched], flat_old[:, untouched])
        torch.testing.assert_close(cache, eager)


def test_the_lm_head_warm_up_runs_every_decode_row_count():
    """Start-up runs the LM head once per row count 1..max_num_seqs (the first GEMM of a
    shape cost a served H100 batch one 12-17 ms step each time it shrank to a new one)."""
    from types import SimpleNamespace

    from kvpilot.engine.worker.model_runner import ModelRunner

    rows: list[int] = []
    runner = SimpleNamespace(
        config=SimpleNamespace(hidden_size=8, dtype=torch.float32), device=torch.device("cpu"),
        model=SimpleNamespace(compute_logits=lambda hidden: rows.append(hidden.shape[0])))
    ModelRunner._warm_logits(runner, 5)  # type: ignore[arg-type]  # a stand-in runner
    assert rows == [1, 2, 3, 4, 5]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with compiled Triton")
@pytest.mark.parametrize("mixed_mode", ["full", "piecewise"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_mixed_steps_through_piecewise_graphs_match_eager_ones(model, mixed_mode, monkeypatch):
    """Prompt chunks beside decodes (a 48-token budget) replay the mixed-step graphs, full
    (attention inside: the unified kernel) or piecewise: greedy tokens as eager mixed steps
    give them (bf16 near-ties aside, as above), and KV written by the padded graphs read back
    correctly by later decode steps."""
    from kvpilot.engine.entrypoints.llm import LLM
    from kvpilot.engine.worker.piecewise_graphs import ENV

    rng = random.Random(1)
    prompts = [[rng.randrange(5, 1024) for _ in range(n)] for n in (3, 90, 17, 200, 41, 7, 130)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)
    common = {"device": "cuda", "num_kv_blocks": 256, "max_num_seqs": 8, "block_size": 16,
              "max_num_batched_tokens": 48, "enable_prefix_caching": True}
    runs = {}
    for name, env in [("eager-mixed", "0"), ("graphs", mixed_mode)]:
        monkeypatch.setenv(ENV, env)
        llm = LLM(model, **common)
        runs[name] = llm.generate(prompts, params)
        mixed = llm.engine.runner.mixed_graphs
        if name == "graphs":
            assert mixed is not None and mixed.mode == mixed_mode, "no mixed graphs captured"
            assert llm.engine.runner.num_piecewise_steps > 5, "hardly any step ran in graphs"
            assert llm.engine.runner.num_eager_steps == 0  # every step fits a bucket or a graph
        else:
            assert mixed is None
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    verdicts = [first_divergence_ok(r, g) for r, g in zip(runs["eager-mixed"], runs["graphs"],
                                                            strict=True)]
    assert all(ok for _, ok in verdicts), verdicts
    assert sum(exact for exact, _ in verdicts) >= len(prompts) // 2, verdicts
