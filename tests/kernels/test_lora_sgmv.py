"""The batched LoRA kernel (shrink + expand) against its torch reference: fp32 in Triton's
interpreter on CPU, bf16/fp16 on a GPU; mixes of adapters and base tokens."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, DTYPES, ON_GPU, rel_err, tolerance

from kvpilot.kernels.lora_sgmv import group_by_slot, lora_ref, lora_sgmv_


def _case(tokens: int, slots: list[int], num_slots: int, rank: int, k: int, n: int,
          dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen).to(dtype=dtype, device=DEVICE)
    a = (torch.randn(num_slots, rank, k, generator=gen) * 0.1).to(dtype=dtype, device=DEVICE)
    b = (torch.randn(num_slots, n, rank, generator=gen) * 0.1).to(dtype=dtype, device=DEVICE)
    base = torch.randn(tokens, n, generator=gen).to(dtype=dtype, device=DEVICE)
    return x, a, b, base, torch.tensor(slots, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("slots", "num_slots", "rank", "k", "n"), [
    ([0], 1, 16, 64, 48),  # one decode token, one adapter
    ([-1, 0, 1, -1, 2, 1, 0, 2, -1], 3, 8, 40, 72),  # a mix with base tokens, ragged sizes
    ([1] * 20 + [-1] * 5 + [0] * 17, 2, 48, 96, 32),  # more tokens of a slot than BLOCK_M
    ([0, 1, 1, 0], 2, 16, 200, 24),  # K not a multiple of BLOCK_K * SPLIT_K
    ([-1] * 6, 2, 16, 32, 32),  # no adapter at all: out unchanged
])
@pytest.mark.parametrize("split_k", [None, 1, 3])  # default (split on few tokens), none, 3
def test_lora_sgmv_matches_reference(slots, num_slots, rank, k, n, dtype, split_k):
    x, a, b, base, idx = _case(len(slots), slots, num_slots, rank, k, n, dtype, len(slots) + k)
    out = lora_sgmv_(base.clone(), x, a, b, group_by_slot(idx, num_slots), block_k=16,
                     split_k=split_k)
    ref = base.float() + lora_ref(x.float(), a.float(), b.float(), idx)
    assert rel_err(out, ref) < tolerance(dtype)
    for t, slot in enumerate(slots):  # a base token's row is left exactly as it was
        if slot < 0:
            assert torch.equal(out[t], base[t])


def test_group_by_slot_orders_tokens_and_counts_each_slot():
    order, counts, starts = group_by_slot(torch.tensor([1, -1, 0, 1, -1]), num_slots=3)
    assert order.tolist() == [1, 4, 2, 0, 3]
    assert counts.tolist() == [2, 1, 2, 0]
    assert starts.tolist() == [0, 2, 3, 5]


def test_lora_ref_adds_only_to_adapter_tokens():
    x = torch.ones(3, 2)
    a = torch.ones(1, 1, 2)  # rank 1: x @ a^T = 2
    b = torch.full((1, 4, 1), 0.5)
    delta = lora_ref(x, a, b, torch.tensor([-1, 0, -1]))
    assert delta.tolist() == [[0.0] * 4, [1.0] * 4, [0.0] * 4]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("tokens", "k"), [(512, 2048), (64, 3072)])  # prefill, decode (split K)
def test_lora_sgmv_large_bf16_batch_on_gpu(tokens: int, k: int):
    slots = [(t % 9) - 1 for t in range(tokens)]  # 8 adapters and the base, interleaved
    x, a, b, base, idx = _case(tokens, slots, 8, 16, k, 2048, torch.bfloat16, 7)
    out = lora_sgmv_(base.clone(), x, a, b, group_by_slot(idx, 8))
    ref = base.float() + lora_ref(x.float(), a.float(), b.float(), idx)
    assert rel_err(out, ref) < tolerance(torch.bfloat16)
