"""Plugs the Triton kernels of `kvpilot.kernels` into a model's seams (CUDA only)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvpilot.engine.models.layers import FeedForward, Linear, RMSNorm
from kvpilot.engine.models.llama import Attention
from kvpilot.engine.models.parallel_layers import ParallelLMHead, RowParallelLinear
from kvpilot.engine.models.rope import RotaryEmbedding
from kvpilot.engine.parallel.symm_mem_all_reduce import SymmMemAllReduce


def use_fused_kernels(model: nn.Module) -> list[str]:
    """Swaps RMSNorm (+ residual add), SiLU-and-mul, rotary and the projections' (1 to 64 rows)
    and the LM head's (one row) matmul for Triton kernels in place, and gives qk_norm
    attention layers (Qwen3) q/k norm and rotary in one kernel, Llama rotary and the KV write;
    gives the names of the seams it swapped."""
    from kvpilot.kernels.activation import silu_and_mul
    from kvpilot.kernels.qk_norm_rotary import (
        matches_unfused_bits,
        qk_norm_rotary,
        rotary_kv_write,
        supports_qk_norm_rotary,
    )
    from kvpilot.kernels.rmsnorm import rms_norm
    from kvpilot.kernels.rotary import rotary_embedding, supports_rotary_dim
    from kvpilot.kernels.w8a16_gemm import decode_linear, one_row_linear

    swapped: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, RMSNorm):
            module.kernel = rms_norm
            swapped.add("rms_norm")
        elif isinstance(module, RotaryEmbedding) and supports_rotary_dim(
                module.cos_sin.shape[1]):
            module.kernel = rotary_embedding
            swapped.add("rotary")
        elif isinstance(module, FeedForward):
            module.act = silu_and_mul
            swapped.add("silu_and_mul")
        elif isinstance(module, ParallelLMHead) or (isinstance(module, Linear)
                                                    and name.rsplit(".", 1)[-1] == "lm_head"):
            module.matmul = one_row_linear  # the tiled kernel is not measured on it
            swapped.add("one_row_gemv")
        elif isinstance(module, Linear):  # the projections
            module.matmul = decode_linear
            swapped.update(("one_row_gemv", "tiled_gemm"))
            if isinstance(module, RowParallelLinear) and not module.reduce_output \
                    and isinstance(module.tp.symm_mem, SymmMemAllReduce) \
                    and module.tp.symm_mem.fused:
                module.matmul = _sending_linear(module.tp.symm_mem)
                swapped.add("linear_send")
    # q/k norm + rotary in one launch (Qwen3) where it gives the bits of the three kernels
    # it replaces; it reads the table of a kernel rope (rotary swapped above)
    rotary_dims = {m.cos_sin.shape[1] for m in model.modules()
                   if isinstance(m, RotaryEmbedding) and m.kernel is not None}
    # likewise rotary + the KV-cache write where a layer has no q/k norms (Llama)
    for module in model.modules():
        if not isinstance(module, Attention) or not rotary_dims or not all(
                supports_qk_norm_rotary(module.head_dim, dim) for dim in rotary_dims):
            continue
        if module.q_norm is not None and module.k_norm is not None \
                and module.q_norm.eps == module.k_norm.eps \
                and matches_unfused_bits(module.head_dim):
            module.qk_norm_rope = qk_norm_rotary
            swapped.add("qk_norm_rotary")
        elif module.q_norm is None and module.k_norm is None:
            module.rope_kv_write = rotary_kv_write
            swapped.add("rotary_kv_write")
    return sorted(swapped)


def _sending_linear(comm: SymmMemAllReduce) -> Callable[..., torch.Tensor]:
    """Gives a row-parallel projection's matmul whose product, for 1 to `w8a16_gemm.MAX_M` rows,
    its kernel also sends into the fused all-reduce's slots (the norm after it sums it:
    `sum_in_next_norm`): the one-row GEMV, or the few-row tiled GEMM in cuBLAS's place."""
    from kvpilot.kernels.w8a16_gemm import decode_linear, takes_16_bit

    def matmul(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        # decode_linear's cases (its switches keep cuBLAS here too), where the group sends
        if bias is None and takes_16_bit(x, weight) \
                and (sent := comm.linear_send(x, weight)) is not None:
            return sent
        return decode_linear(x, weight, bias)
    return matmul
