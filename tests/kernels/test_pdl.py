"""Programmatic dependent launch: when it is on, and that a CUDA graph of dependent decode
kernels launched with it gives the bits it gives without (every kernel waits before it reads
what the one before wrote: drop a kernel's `wait_for_previous` and the GPU case can fail)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE

from kvpilot.kernels import pdl
from kvpilot.kernels.activation import silu_and_mul
from kvpilot.kernels.rmsnorm import rms_norm
from kvpilot.kernels.rotary import rotary_cos_sin_cache, rotary_embedding
from kvpilot.kernels.w8a16_gemm import gemv


def test_off_on_cpu_and_when_turned_off(monkeypatch):
    assert pdl.pdl_args(torch.zeros(1)) == {"PDL": False}
    if DEVICE == "cuda":
        monkeypatch.setattr(pdl, "ENABLED", False)
        assert pdl.pdl_args(torch.zeros(1, device="cuda")) == {"PDL": False}


def decode_chain(x: torch.Tensor, weights: list[torch.Tensor], norm: torch.Tensor,
                 positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """A layer's kernels at batch 1, each reading the last one's output, twice over."""
    residual = torch.zeros_like(x)
    for _ in range(2):
        h, residual = rms_norm(x, norm, 1e-5, residual)  # type: ignore[misc]
        qk = gemv(h, weights[0]).view(1, 4, 64)
        q, k = rotary_embedding(positions, qk[:, :2], qk[:, 2:], cos_sin)
        x = gemv(torch.cat([q, k], 1).view(1, -1) + h[:, :256], weights[1])
        gate_up = gemv(x, weights[2])
        x = gemv(silu_and_mul(gate_up), weights[3])
    return x


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL launches need a CUDA GPU of compute capability 9.0+")
def test_graph_with_pdl_gives_the_same_bits(monkeypatch):
    assert pdl.pdl_args(torch.zeros(1, device="cuda"))["PDL"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(bf16)
    weights = [rand(256, 512) / 16, rand(512, 256) / 16, rand(2048, 512) / 16,
               rand(512, 1024) / 32]
    x, norm = rand(1, 512), rand(512)
    positions = torch.tensor([17], device="cuda")
    cos_sin = rotary_cos_sin_cache(64, 64).to("cuda")

    def replayed() -> torch.Tensor:
        static = x.clone()
        decode_chain(static, weights, norm, positions, cos_sin)  # compiles, tunes
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_chain(static, weights, norm, positions, cos_sin)
        outs = []
        for _ in range(20):
            graph.replay()
            outs.append(out.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(o, outs[0]) for o in outs)
        return outs[0]
    with_pdl = replayed()
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert torch.equal(with_pdl, replayed())
    assert torch.equal(with_pdl, decode_chain(x.clone(), weights, norm, positions, cos_sin))
