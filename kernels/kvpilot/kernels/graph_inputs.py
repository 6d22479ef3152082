"""A decode graph's inputs in one launch: a step's rows copied into the graph's fixed buffers.

A decode step replays a CUDA graph that reads fixed buffers (`kvpilot.engine.worker.cuda_graphs`).
Before the replay, the step's token ids, positions, KV slots, context lengths, launch order and
block tables go into those buffers, and the padding rows up to the graph's bucket get slot -1,
length 0 and their own index as their launch order. Done with torch's `copy_` and `fill_`
(`decode_inputs_ref`), that is nine kernels a step, each a few launch-bound microseconds of GPU
time between two graph replays. This kernel does all of it in one launch: program r writes row r
of every buffer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit


@dataclass(frozen=True)
class DecodeInputs:
    """A decode step's per-row inputs (n rows), or a graph's fixed buffers (bucket rows): token
    ids, positions, KV slots, context lengths, launch order (None: each row's own index) and
    block tables [rows, blocks]."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    order: torch.Tensor | None
    block_tables: torch.Tensor


# the step's sizes and where its rows sit in the step's buffer change every step: no
# specialisation on them or on the source pointers' alignment (each new class a fresh compile)
@jit(do_not_specialize=["n", "width", "stride_src_bt"],
     do_not_specialize_on_alignment=["ids_src", "pos_src", "slot_src", "len_src", "order_src",
                                     "bt_src"])
def _decode_inputs_kernel(
    ids_src, pos_src, slot_src, len_src, order_src, bt_src,
    ids_dst, pos_dst, slot_dst, len_dst, order_dst, bt_dst,
    n, width, stride_src_bt, stride_dst_bt,
    HAS_ORDER: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    if r < n:
        tl.store(ids_dst + r, tl.load(ids_src + r))
        tl.store(pos_dst + r, tl.load(pos_src + r))
        tl.store(slot_dst + r, tl.load(slot_src + r))
        tl.store(len_dst + r, tl.load(len_src + r))
        if HAS_ORDER:
            tl.store(order_dst + r, tl.load(order_src + r))
        else:
            tl.store(order_dst + r, r)
        for c0 in range(0, width, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < width
            row = tl.load(bt_src + r * stride_src_bt + cols, mask=ok)
            tl.store(bt_dst + r * stride_dst_bt + cols, row, mask=ok)
    else:  # a padding row: no KV write, no context, launched in its own place
        tl.store(slot_dst + r, -1)
        tl.store(len_dst + r, 0)
        tl.store(order_dst + r, r)


def copy_decode_inputs(src: DecodeInputs, dst: DecodeInputs, size: int) -> None:
    """Writes the n rows of `src` into rows 0..n-1 of `dst` (block tables: their first
    src.block_tables.shape[1] columns), and pads rows n..size-1 with slot -1, length 0 and
    their own index as order; as `decode_inputs_ref`, in one launch. Input ids and positions
    of the padding rows are left as they are. CPU tensors outside Triton's interpreter take
    `decode_inputs_ref`."""
    n, width = src.block_tables.shape
    if not n <= size <= dst.slot_mapping.shape[0] or width > dst.block_tables.shape[1]:
        raise ValueError(f"{n} rows of {width} blocks do not fit a bucket of {size} rows of "
                         f"{dst.block_tables.shape[1]} blocks")
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        for side in (src, dst):
            t = getattr(side, name)
            if t.dim() != 1 or t.stride(0) != 1:
                raise ValueError(f"{name} must be dense 1-D rows")
    if src.block_tables.stride(1) != 1 or dst.block_tables.stride(1) != 1:
        raise ValueError("block tables need dense rows")
    assert dst.order is not None, "the graph's buffers hold a launch order"
    if not dst.input_ids.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        decode_inputs_ref(src, dst, size)
        return
    if size == 0:
        return
    order = _step_order(src)
    _decode_inputs_kernel[(size,)](
        src.input_ids, src.positions, src.slot_mapping, src.seq_lens,
        src.seq_lens if order is None else order, src.block_tables,
        dst.input_ids, dst.positions, dst.slot_mapping, dst.seq_lens, dst.order,
        dst.block_tables, n, width, src.block_tables.stride(0), dst.block_tables.stride(0),
        HAS_ORDER=order is not None,
        BLOCK=min(1024, triton.next_power_of_2(max(1, dst.block_tables.shape[1]))),
        num_warps=1,
    )


def _step_order(src: DecodeInputs) -> torch.Tensor | None:
    """Gives the step's launch order, or None where it has none of its n rows (a stale order
    of another step's length counts as none): each row is then launched in its own place."""
    order = src.order
    return order if order is not None and order.shape[0] == src.block_tables.shape[0] else None


def decode_inputs_ref(src: DecodeInputs, dst: DecodeInputs, size: int) -> None:
    """`copy_decode_inputs` with torch's copy_ and fill_ (nine kernels on a GPU)."""
    n, width = src.block_tables.shape
    dst.input_ids[:n].copy_(src.input_ids)
    dst.positions[:n].copy_(src.positions)
    dst.slot_mapping[:n].copy_(src.slot_mapping)
    dst.slot_mapping[n:size].fill_(-1)
    dst.seq_lens[:n].copy_(src.seq_lens)
    dst.seq_lens[n:size].fill_(0)
    assert dst.order is not None
    identity = torch.arange(size, dtype=dst.order.dtype, device=dst.order.device)
    order = _step_order(src)
    dst.order[:n].copy_(identity[:n] if order is None else order)
    dst.order[n:size].copy_(identity[n:size])
    dst.block_tables[:n, :width].copy_(src.block_tables)
