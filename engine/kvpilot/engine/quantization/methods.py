"""The 8-bit weight formats: how a [out, in] weight is quantised (one float32 scale per
output row) and how a quantised linear layer multiplies.

- int8 (W8A16): weights in int8, activations stay in the model dtype. On CUDA, batches of
  up to 64 rows go through a Triton GEMM that widens int8 tiles in registers
  (kvpilot.kernels.w8a16_gemm); elsewhere, and for larger batches, the weight is widened
  to the activation dtype and multiplied, then each output column is scaled.
- fp8 (W8A8): weights in float8 E4M3; each token's activations are scaled into E4M3
  on the fly (dynamic per-token scales) and `torch._scaled_mm` multiplies the two on
  FP8 tensor cores (compute capability 8.9+). Decode-sized batches (up to 64 rows) are
  bound by reading the weight, where cuBLASLt's FP8 GEMM and the activation quantisation
  cost more than they save: they go through the W8A16 Triton GEMM above with the E4M3
  weight (weight-only, activations unrounded). Off CUDA the W8A8 arithmetic runs as a
  float32 reference (what the GPU path is tested against); the engine refuses fp8 there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch.nn import functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
INT8_MAX = 127
# keeps an all-zero row or token from dividing by zero
_MIN_SCALE = 1e-12


class QuantMethod(ABC):
    """One 8-bit format: quantises weights and runs the matmul over them."""

    name: str
    weight_dtype: torch.dtype
    max_value: float

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gives (8-bit weight [out, in], float32 scale [out]) with weight ~ q * scale[:, None]."""
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=_MIN_SCALE) / self.max_value
        return self.cast(w / scale[:, None]), scale

    @abstractmethod
    def cast(self, scaled: torch.Tensor) -> torch.Tensor:
        """Gives float32 values already in [-max, max] stored in the 8-bit dtype."""

    @abstractmethod
    def matmul(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Gives x @ (weight * scale[:, None]).T in x's dtype, for x [..., in]."""


class Int8WeightOnly(QuantMethod):
    name = "int8"
    weight_dtype = torch.int8
    max_value = INT8_MAX

    def cast(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.is_cuda:
            from kvpilot.kernels.w8a16_gemm import MAX_M, w8a16_gemm

            if rows.shape[0] <= MAX_M:  # decode sizes: read the int8 weight once
                out = w8a16_gemm(rows.contiguous(), weight, scale)
                return out.reshape(*x.shape[:-1], weight.shape[0])
        return (F.linear(x, weight.to(x.dtype)) * scale).to(x.dtype)


class Fp8DynamicPerToken(QuantMethod):
    name = "fp8"
    weight_dtype = FP8_DTYPE
    max_value = FP8_MAX

    def cast(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.is_cuda:
            from kvpilot.kernels.w8a16_gemm import MAX_M, w8a16_gemm

            if rows.shape[0] <= MAX_M:  # decode sizes: read the E4M3 weight once
                out = w8a16_gemm(rows.contiguous(), weight, scale)
                return out.reshape(*x.shape[:-1], weight.shape[0])
        x_q, x_scale = quantize_per_token(rows)
        if rows.is_cuda:
            # weight [out, in] row-major: its .t() is the column-major [in, out] cuBLASLt wants.
            # Row-wise scales need a bf16 output.
            scaled_mm = torch._scaled_mm  # pyright: ignore[reportPrivateImportUsage]
            out = scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1),
                            out_dtype=torch.bfloat16)
        else:
            out = fp8_matmul_ref(x_q, x_scale, weight, scale)
        return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def quantize_per_token(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives (E4M3 rows [M, K], float32 scale [M, 1]) with rows ~ q * scale."""
    r = rows.float()
    scale = r.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_SCALE) / FP8_MAX
    return (r / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_matmul_ref(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                   scale: torch.Tensor) -> torch.Tensor:
    """Gives what `torch._scaled_mm` computes with row-wise scales, in float32 (the reference)."""
    return (x_q.float() @ weight.float().t()) * x_scale * scale.view(1, -1)


METHODS: dict[str, QuantMethod] = {m.name: m for m in (Int8WeightOnly(), Fp8DynamicPerToken())}
