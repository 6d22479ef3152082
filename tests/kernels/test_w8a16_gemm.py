"""The W8A16 decode GEMM against its torch reference (float32 on CPU in the interpreter,
bf16 on a GPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, DTYPES, rel_err, tolerance

from kvpilot.kernels.w8a16_gemm import (
    gemv,
    one_row_linear,
    skinny_linear,
    w8a16_gemm,
    w8a16_gemm_ref,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k"), [
    (1, 48, 64),  # one decode row (the GEMV), N not a multiple of the block
    (1, 50, 300),  # the GEMV with K not a multiple of BLOCK_K
    (5, 64, 300),  # K not a multiple of BLOCK_K
    (17, 16, 512),  # rows padded to 32
    (64, 40, 96),  # the most rows the kernel takes
])
def test_w8a16_matches_reference(rows, n, k, dtype):
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype=dtype, device=DEVICE)
    weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(DEVICE)
    scale = (torch.rand(n, generator=gen) * 0.01 + 1e-4).to(DEVICE)
    out = w8a16_gemm(x, weight, scale, block_k=128)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert rel_err(out, w8a16_gemm_ref(x, weight, scale)) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_row_gemv_matches_the_tiled_kernel(monkeypatch, dtype):
    """The one-row GEMV and the `tl.dot` kernel it stands in for give the same row."""
    import kvpilot.kernels.w8a16_gemm as gemm

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 320, generator=gen).to(dtype=dtype, device=DEVICE)
    weight = torch.randint(-127, 128, (72, 320), generator=gen, dtype=torch.int8).to(DEVICE)
    scale = (torch.rand(72, generator=gen) * 0.01 + 1e-4).to(DEVICE)
    gemv = w8a16_gemm(x, weight, scale, block_k=128)
    monkeypatch.setattr(gemm, "USE_GEMV", False)
    tiled = w8a16_gemm(x, weight, scale, block_k=128)
    assert rel_err(gemv, tiled) < tolerance(dtype)


def test_w8a16_refuses_a_large_batch():
    with pytest.raises(AssertionError, match="torch path"):
        w8a16_gemm(torch.zeros(65, 16), torch.zeros(16, 16, dtype=torch.int8), torch.ones(16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(48, 64), (50, 300)])
def test_the_gemv_takes_a_16_bit_weight(n, k, dtype):
    """A bf16 model's batch-1 projections: the same GEMV without a scale."""
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen).to(dtype=dtype, device=DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype=dtype, device=DEVICE)
    out = gemv(x, weight, block_k=128)
    assert out.shape == (1, n) and out.dtype == dtype
    assert rel_err(out, (x.float() @ weight.float().t()).to(dtype)) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k"), [(2, 48, 64), (17, 50, 300), (64, 96, 256)])
def test_the_tiled_kernel_takes_a_16_bit_weight(rows, n, k, dtype):
    """A row-parallel projection's 2 to 64 rows that send (`gemm_send`): the same kernel
    without a scale; autotuned on a GPU, the default tiles in the interpreter."""
    gen = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype=dtype, device=DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype=dtype, device=DEVICE)
    out = skinny_linear(x, weight)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert rel_err(out, (x.float() @ weight.float().t()).to(dtype)) < tolerance(dtype)
    for wrong in (1, 65):  # the GEMV's one row; beyond MAX_M
        with pytest.raises(AssertionError, match="rows"):
            skinny_linear(x[:1].expand(wrong, k), weight)


def test_one_row_linear_is_f_linear_off_its_case():
    """Off CUDA, and on CUDA for more than one row, the seam is F.linear itself."""
    gen = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(3, 8, generator=gen), torch.randn(5, 8, generator=gen), \
        torch.randn(5, generator=gen)
    assert torch.equal(one_row_linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
