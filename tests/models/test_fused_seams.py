"""`use_fused_kernels` puts the Triton kernels into every seam of a model (CPU: the swap
itself; the kernels' numbers are the kernel tests' and the GPU model tests')."""

from __future__ import annotations

import os

import pytest

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.fused import use_fused_kernels
from kvpilot.engine.models.layers import Linear
from kvpilot.engine.models.loader import load_model
from kvpilot.kernels.w8a16_gemm import decode_linear, one_row_linear


def test_every_projection_and_the_lm_head_get_the_decode_matmuls(tiny_checkpoints):
    """The projections: the one-row GEMV and the tiled kernel up to 64 rows; the LM head: the
    GEMV (the tiled kernel is not measured on a vocabulary-wide weight)."""
    import torch

    config = ModelConfig.from_engine_args(EngineArgs(model=str(tiny_checkpoints("llama"))),
                                          torch.device("cpu"))
    model = load_model(config, "auto", "cpu", fused_kernels=False)
    projections = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, Linear)}
    assert projections == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert {"one_row_gemv", "tiled_gemm"} <= set(use_fused_kernels(model))
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            assert m.matmul is (one_row_linear if name == "lm_head" else decode_linear), name


def _device() -> str:
    """Gives where the kernels run: CUDA unless Triton interprets them on the CPU."""
    import torch

    gpu = os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.is_available()
    return "cuda" if gpu else "cpu"


@pytest.fixture(scope="module")
def qwen3_checkpoints(tmp_path_factory):
    """Gives head_dim -> a tiny Qwen3 checkpoint dir with heads that long (the shared tiny
    Qwen3's are 32: too short for the fused q/k norm + rotary, see matches_unfused_bits)."""
    from helpers.checkpoints import write_checkpoint

    root, written = tmp_path_factory.mktemp("qwen3"), {}

    def get(head_dim: int):
        if head_dim not in written:
            written[head_dim] = write_checkpoint(root / str(head_dim), "qwen3",
                                                 head_dim=head_dim)
        return written[head_dim]

    return get


def _model(path, dtype="float32", device="cpu"):
    import torch

    config = ModelConfig.from_engine_args(EngineArgs(model=str(path), dtype=dtype),
                                          torch.device(device))
    return load_model(config, "auto", device, fused_kernels=False)


def _paged_case(path, dtype: str):
    """Gives (model, prompts, allocation, steps, device) of the paged-steps tests: three
    prompts in prefill chunks, then decode rows mixed with a chunk."""
    import torch
    from helpers.paged import BlockAllocation

    seq_lens, steps = [9, 4, 13], [[5, 4, 6], [1, 0, 7], [3, 0, 0]]
    alloc = BlockAllocation.shuffled(seq_lens, block_size=4, seed=3)
    gen = torch.Generator().manual_seed(5)
    device = _device()
    if dtype == "bfloat16" and device == "cpu":
        pytest.skip("Triton's interpreter gets bf16 arithmetic wrong")
    model = _model(path, dtype, device)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in seq_lens]
    return model, prompts, alloc, steps, device


@pytest.mark.parametrize(("family", "head_dim", "fused", "rope_kv"), [
    ("qwen3", 64, True, False),
    ("qwen3", 128, True, False),
    ("qwen3", 32, False, False),  # one warp's row: rms_norm's bits are not reproducible
    ("qwen3", 48, False, False),  # no power of two: rotary (and so the fusion) stays unfused
    ("llama", None, False, True),  # no q/k norm: rotary + the KV write
    ("mixtral", None, False, True),
])
def test_only_qk_norm_models_get_the_fused_qk_norm_rotary(tiny_checkpoints, qwen3_checkpoints,
                                                          family, head_dim, fused, rope_kv):
    from kvpilot.engine.models.llama import Attention
    from kvpilot.kernels.qk_norm_rotary import qk_norm_rotary, rotary_kv_write

    model = _model(qwen3_checkpoints(head_dim) if head_dim else tiny_checkpoints(family))
    swapped = use_fused_kernels(model)
    assert "rms_norm" in swapped
    assert ("rotary" in swapped) == (head_dim != 48)
    assert ("qk_norm_rotary" in swapped) == fused
    assert ("rotary_kv_write" in swapped) == rope_kv
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert layers and all((m.qk_norm_rope is qk_norm_rotary) == fused for m in layers)
    assert all((m.rope_kv_write is rotary_kv_write) == rope_kv for m in layers)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_fused_qk_norm_rotary_gives_the_logits_of_the_unfused_kernels(qwen3_checkpoints, dtype):
    """Qwen3 through paged steps (prefill chunks, then decode rows mixed with a chunk): one
    fused launch per layer gives the bits of q_norm, k_norm and rotary as three kernels."""
    import torch
    from helpers.paged import step_logits

    from kvpilot.engine.models.llama import Attention
    from kvpilot.kernels.rmsnorm import rms_norm

    model, prompts, alloc, steps, device = _paged_case(qwen3_checkpoints(64), dtype)
    assert "qk_norm_rotary" in use_fused_kernels(model)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    fused_seam = layers[0].qk_norm_rope
    assert fused_seam is not None
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].shape[0])
        return fused_seam(*args, **kwargs)

    def never(*args, **kwargs):
        raise AssertionError("q_norm/k_norm ran beside the fused kernel")

    for attn in layers:
        attn.qk_norm_rope = counted
        assert attn.q_norm is not None and attn.k_norm is not None
        assert attn.q_norm.kernel is rms_norm and attn.k_norm.kernel is rms_norm
        attn.q_norm.kernel = attn.k_norm.kernel = never
    fused = step_logits(model, prompts, alloc, steps, device)
    assert calls == [sum(s) for s in steps for _ in layers]  # one launch per layer and step

    for attn in layers:  # back to the three unfused kernels
        attn.qk_norm_rope = None
        assert attn.q_norm is not None and attn.k_norm is not None
        attn.q_norm.kernel = attn.k_norm.kernel = rms_norm
    unfused = step_logits(model, prompts, alloc, steps, device)
    for got, want in zip(fused, unfused, strict=True):
        assert torch.equal(got, want)

    tol = 1e-4 if dtype == "float32" else 2e-2
    # a torch rope (no rotary kernel) keeps the unfused path even with the seam set
    model.model.rotary.kernel = None
    for attn in layers:
        attn.qk_norm_rope = counted
    calls.clear()
    torch_rope = step_logits(model, prompts, alloc, steps, device)
    assert not calls
    for got, want in zip(torch_rope, unfused, strict=True):
        assert ((got - want).abs().max() / want.abs().max()).item() < tol


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rotary_kv_write_gives_the_logits_of_the_unfused_kernels(tiny_checkpoints, dtype):
    """Llama through paged steps: rotary and the KV write as one launch per layer give the
    bits of the rotary kernel then the backend's own write."""
    import torch
    from helpers.paged import step_logits

    from kvpilot.engine.models.llama import Attention

    model, prompts, alloc, steps, device = _paged_case(tiny_checkpoints("llama"), dtype)
    assert "rotary_kv_write" in use_fused_kernels(model)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    seam = layers[0].rope_kv_write
    assert seam is not None
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].shape[0])
        return seam(*args, **kwargs)

    for attn in layers:
        attn.rope_kv_write = counted
    fused = step_logits(model, prompts, alloc, steps, device)
    assert calls == [sum(s) for s in steps for _ in layers]  # one launch per layer and step
    for attn in layers:  # back to the rotary kernel and the backend's KV write
        attn.rope_kv_write = None
    unfused = step_logits(model, prompts, alloc, steps, device)
    for got, want in zip(fused, unfused, strict=True):
        assert torch.equal(got, want)
