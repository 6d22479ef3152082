"""The batched LoRA kernel (shrink + expand) against its torch reference: fp32 in Triton's
interpreter on CPU, bf16/fp16 on a GPU; mixes of adapters and base tokens."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, DTYPES, ON_GPU, rel_err, tolerance

from kvpilot.kernels.lora_sgmv import BLOCK_M, group_by_slot, lora_ref, lora_sgmv_, max_blocks


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
    grouped = group_by_slot(torch.tensor([1, -1, 0, 1, -1]), num_slots=3)
    assert grouped.order.tolist() == [1, 4, 2, 0, 3]
    assert grouped.counts.tolist() == [2, 1, 2, 0]
    assert grouped.starts.tolist() == [0, 2, 3, 5]


# mixes for the block table: (name, slots, S)
_MIXES = [
    ("all base", [-1] * 6, 2),
    ("one slot, 17 tokens", [0] * 17, 1),
    ("partial blocks", [2] * 3 + [-1] * 4 + [0] * 5 + [1] * 20 + [-1, 2], 3),
    ("empty slot between", [3, 0, -1, 3, 0, 0] + [3] * 16, 5),
]
# (slot, first index into order, tokens) of each used block, in the table's order
_BLOCKS = {
    "all base": [],
    "one slot, 17 tokens": [(0, 0, 16), (0, 16, 1)],
    # order: 5 base tokens, then slot 0's 5, slot 1's 20 (16 + 4), slot 2's 4
    "partial blocks": [(0, 5, 5), (1, 10, 16), (1, 26, 4), (2, 30, 4)],
    # order: 1 base token, slot 0's 3, slot 3's 18 (16 + 2); slots 1, 2 and 4 empty
    "empty slot between": [(0, 1, 3), (3, 4, 16), (3, 20, 2)],
}


def _table(slots: list[int], num_slots: int, block_m: int) -> list[tuple[int, int, int]]:
    """The block table, built on the host the plain way: (slot, start, count) per block."""
    table, start = [], sum(1 for s in slots if s < 0)
    for slot in range(num_slots):
        count = sum(1 for s in slots if s == slot)
        table += [(slot, start + m0, min(block_m, count - m0)) for m0 in range(0, count, block_m)]
        start += count
    return table


def _rows(grouped) -> list[tuple[int, int, int]]:
    return list(zip(grouped.block_slot.tolist(), grouped.block_start.tolist(),
                    grouped.block_count.tolist(), strict=True))


@pytest.mark.parametrize(("name", "slots", "num_slots"), _MIXES, ids=[m[0] for m in _MIXES])
def test_block_table_covers_each_slot_in_blocks(name, slots, num_slots):
    grouped = group_by_slot(torch.tensor(slots, dtype=torch.int32), num_slots)
    rows = _rows(grouped)
    assert len(rows) == max_blocks(len(slots), num_slots) == -(-len(slots) // BLOCK_M) + num_slots
    used = [row for row in rows if row[0] >= 0]
    assert used == _BLOCKS[name] == _table(slots, num_slots, BLOCK_M)
    assert rows[len(used):] == [(-1, 0, 0)] * (len(rows) - len(used))  # unused rows last
    order = grouped.order.tolist()
    for slot, start, count in used:  # each block's tokens are its slot's
        assert all(slots[t] == slot for t in order[start:start + count])


@pytest.mark.parametrize("seed", range(6))
def test_block_table_matches_a_host_build_for_random_mixes(seed):
    gen = torch.Generator().manual_seed(seed)
    num_slots = int(torch.randint(1, 9, (), generator=gen))
    tokens = int(torch.randint(1, 90, (), generator=gen))
    slots = torch.randint(-1, num_slots, (tokens,), generator=gen, dtype=torch.int32)
    for block_m in (4, 16):
        grouped = group_by_slot(slots, num_slots, block_m)
        assert len(_rows(grouped)) == max_blocks(tokens, num_slots, block_m)
        used = [row for row in _rows(grouped) if row[0] >= 0]
        assert used == _table(slots.tolist(), num_slots, block_m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "slots", "num_slots"), _MIXES, ids=[m[0] for m in _MIXES])
@pytest.mark.parametrize("split_k", [None, 1, 4])
def test_lora_sgmv_matches_reference_over_block_table_mixes(name, slots, num_slots, dtype,
                                                             split_k):
    x, a, b, base, idx = _case(len(slots), slots, num_slots, 24, 80, 136, dtype, len(name))
    out = lora_sgmv_(base.clone(), x, a, b, group_by_slot(idx, num_slots), block_k=16,
                     split_k=split_k)
    ref = base.float() + lora_ref(x.float(), a.float(), b.float(), idx)
    if all(s < 0 for s in slots):
        assert torch.equal(out, base)
    else:
        assert rel_err(out, ref) < tolerance(dtype)
    for t, slot in enumerate(slots):
        if slot < 0:
            assert torch.equal(out[t], base[t])


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


@pytest.mark.parametrize(("parts", "reads_parts_only"), [
    ((32, 16, 16), True),  # q|k|v: every part ends on a block of 16 columns
    ((48, 48), True),  # gate|up
    ((40, 24), False),  # part 0 ends inside a column block: the whole rank is read
])
def test_expand_reads_only_a_merged_parts_rank_columns(parts, reads_parts_only):
    """B of a merged projection holds part p's adapter in its rank columns p*R/P..; the
    rest is zero in the engine. Filled with noise here, it is left out of the product when
    the parts line up with the column blocks, and read (so it shows) when they do not."""
    slots = [0, -1, 1, 1, 0, 2]
    rank, k, n = 8 * len(parts), 32, sum(parts)
    x, a, b, base, idx = _case(len(slots), slots, 3, rank, k, n, torch.float32, 5)
    stacked = torch.zeros_like(b)
    width, first = rank // len(parts), 0
    for p, rows in enumerate(parts):
        cols = slice(p * width, (p + 1) * width)
        stacked[:, first:first + rows, cols] = b[:, first:first + rows, cols]
        first += rows
    noisy = stacked + (stacked == 0) * 5.0  # noise wherever a part has no adapter
    out = lora_sgmv_(base.clone(), x, a, noisy, group_by_slot(idx, 3), block_n=16,
                     block_k=16, parts=parts)
    ref = base.float() + lora_ref(x.float(), a.float(), stacked.float(), idx)
    assert (rel_err(out, ref) < tolerance(torch.float32)) == reads_parts_only
