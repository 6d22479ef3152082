"""The models on a CUDA GPU: fp32 parity with HF, and the Triton backend as a drop-in."""

from __future__ import annotations

import pytest
import torch
from helpers.checkpoints import load_hf_model
from helpers.paged import BlockAllocation, step_logits

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.fused import use_fused_kernels
from kvpilot.engine.models.loader import load_model

pytestmark = pytest.mark.gpu
# Triton's decode path expects decode rows first, as the model runner orders them.
SEQ_LENS, QUERY_LENS = [30, 17, 41, 12], [1, 1, 41, 5]


def paged_logits(model, prompts: list[torch.Tensor], device: str) -> list[torch.Tensor]:
    """Gives every prompt's logits from two steps: all but the last QUERY_LENS tokens first,
    then a flat step mixing decode rows with prefill chunks."""
    first = [s - q for s, q in zip(SEQ_LENS, QUERY_LENS, strict=True)]
    alloc = BlockAllocation.shuffled(SEQ_LENS, block_size=16)
    return step_logits(model, prompts, alloc, [first, QUERY_LENS], device)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_cuda_fp32_matches_hf(tiny_checkpoints, family, fused):
    path = tiny_checkpoints(family)
    config = ModelConfig.from_engine_args(EngineArgs(model=str(path), dtype="float32"),
                                          torch.device("cuda"))
    model = load_model(config, "auto", "cuda", fused_kernels=fused)
    assert (model.model.norm.kernel is not None) == fused
    hf = load_hf_model(path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in SEQ_LENS]
    got = paged_logits(model, prompts, "cuda")
    for g, p in zip(got, prompts, strict=True):
        expected = hf(p[None]).logits[0]
        assert ((g - expected).abs().max() / expected.abs().max()).item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_triton_backend_drops_in_for_bf16(tiny_checkpoints, family):
    from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
    from kvpilot.engine.attention.triton_backend import TritonAttentionBackend

    path = tiny_checkpoints(family)
    config = ModelConfig.from_engine_args(EngineArgs(model=str(path)), torch.device("cuda"))
    assert config.dtype == torch.bfloat16
    model = load_model(config, "auto", "cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in SEQ_LENS]
    model.attn_backend = TorchAttentionBackend()
    reference = paged_logits(model, prompts, "cuda")
    model.attn_backend = TritonAttentionBackend()
    for got, want in zip(paged_logits(model, prompts, "cuda"), reference, strict=True):
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_fused_kernels_track_torch_ops_in_bf16(tiny_checkpoints, family):
    path = tiny_checkpoints(family)
    config = ModelConfig.from_engine_args(EngineArgs(model=str(path)), torch.device("cuda"))
    plain = load_model(config, "auto", "cuda", fused_kernels=False)
    fused = load_model(config, "auto", "cuda")  # default on CUDA
    # (the fused rotary kernels join these where the head sizes allow)
    assert {"one_row_gemv", "tiled_gemm", "rms_norm", "rotary", "silu_and_mul"} <= set(
        use_fused_kernels(load_model(config, "auto", "cuda", fused_kernels=False)))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in SEQ_LENS]
    for got, want in zip(paged_logits(fused, prompts, "cuda"), paged_logits(plain, prompts, "cuda"),
                         strict=True):
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_decode_step_replays_in_a_cuda_graph(tiny_checkpoints, family):
    """The runner captures decode steps; the model (MoE included) must not sync the host."""
    from kvpilot.engine.attention.triton_backend import TritonAttentionBackend

    path = tiny_checkpoints(family)
    config = ModelConfig.from_engine_args(EngineArgs(model=str(path)), torch.device("cuda"))
    model = load_model(config, "auto", "cuda")
    model.attn_backend = TritonAttentionBackend()
    seq_lens = [9, 33, 17]
    alloc = BlockAllocation.shuffled(seq_lens, block_size=16)
    meta = alloc.step(seq_lens, [1, 1, 1], "cuda")
    assert meta.num_decode_tokens == 3
    caches = [torch.randn(2, alloc.num_blocks, 16, config.num_kv_heads, config.head_dim,
                          dtype=config.dtype, device="cuda") for _ in range(config.num_layers)]
    ids = torch.tensor([5, 6, 7], device="cuda")
    positions = torch.tensor([s - 1 for s in seq_lens], device="cuda")
    eager = model.compute_logits(model(ids, positions, caches, meta))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model(ids, positions, caches, meta)  # warm-up compiles the kernels outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = model.compute_logits(model(ids, positions, caches, meta))
    graph.replay()
    torch.testing.assert_close(captured, eager, rtol=2e-2, atol=2e-2)
