"""The decode graph's one-launch input copy against torch's nine copy_/fill_ calls."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE

from kvpilot.kernels.graph_inputs import DecodeInputs, copy_decode_inputs, decode_inputs_ref

BUCKET, MAX_BLOCKS = 24, 40


def graph_buffers(seed: int, max_blocks: int = MAX_BLOCKS) -> DecodeInputs:
    """A graph's buffers holding an earlier, larger step's rows (what a replay writes over)."""
    g = torch.Generator().manual_seed(seed)

    def ints(*shape, dtype=torch.long):
        return torch.randint(0, 1000, shape, generator=g).to(dtype).to(DEVICE)
    return DecodeInputs(ints(BUCKET), ints(BUCKET), ints(BUCKET), ints(BUCKET, dtype=torch.int32),
                        ints(BUCKET), ints(BUCKET, max_blocks, dtype=torch.int32))


def step(n: int, width: int, order: str, seed: int) -> DecodeInputs:
    """A step of n rows as the model runner hands it over (views of one int64 buffer, lengths
    and tables converted to int32); `order`: "given", "none" or "stale" (a step's order of a
    different length, which the graph ignores)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 10_000, (5 * n + n * width,), generator=g).to(DEVICE)
    orders = {"given": buf[4 * n:5 * n].flip(0), "none": None, "stale": buf[:n + 1]}
    return DecodeInputs(buf[:n], buf[n:2 * n], buf[2 * n:3 * n] - 5_000,
                        buf[3 * n:4 * n].to(torch.int32), orders[order],
                        buf[5 * n:].view(n, width).to(torch.int32))


@pytest.mark.parametrize(("n", "size", "width", "order", "max_blocks"), [
    (1, 1, 1, "given", MAX_BLOCKS),
    (5, 8, 7, "given", MAX_BLOCKS),  # padding rows, a narrower table than the buffer's
    (5, 8, 7, "none", MAX_BLOCKS),
    (7, 8, MAX_BLOCKS, "stale", MAX_BLOCKS),
    (24, 24, 3, "given", MAX_BLOCKS),  # a full bucket
    (3, 4, 1500, "given", 1600),  # rows wider than the kernel's 1024-column tile: two tiles
])
def test_copy_matches_torch_copies(n, size, width, order, max_blocks):
    src = step(n, width, order, seed=n + width)
    got, want = graph_buffers(1, max_blocks), graph_buffers(1, max_blocks)
    copy_decode_inputs(src, got, size)
    decode_inputs_ref(src, want, size)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "order", "block_tables"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.slot_mapping[n:size] == -1).all() and (got.seq_lens[n:size] == 0).all()


def test_rows_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        copy_decode_inputs(step(9, 3, "none", 0), graph_buffers(0), size=8)
    with pytest.raises(ValueError, match="do not fit"):
        copy_decode_inputs(step(2, MAX_BLOCKS + 1, "none", 0), graph_buffers(0), size=8)
