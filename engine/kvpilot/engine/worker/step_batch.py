"""One scheduled step as one int64 buffer: packed by the driver, unpacked by every rank.

The engine loop describes a step as `BatchEntry`s, one per scheduled sequence.

The driver (`pack_step`) lays the step out in numpy: the new tokens end to end
(decodes first), their positions and KV slots, query start offsets, sequence
lengths, the decode rows' launch order (longest context first), block tables, the (position, sampled row) pairs of tokens still being
sampled (async scheduling), the logits rows and the block copies. A `StepHeader`
of fixed length carries the sizes. Every rank (`unpack_step`) takes views of the
buffer once it is on its device: the single-rank runner after one host-to-device
copy, the workers of a tensor-parallel engine after one broadcast of header and
buffer (no Python objects pickled per step).
"""

from __future__ import annotations

import itertools
from dataclasses import astuple, dataclass, fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvpilot.engine.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from kvpilot.engine.worker.device import StagingBuffer

STEP, STOP = 1, 0  # StepHeader.command
# StepHeader.command of a KV load (`StepChannel.send_load`): no step, blocks to write
LOAD_KV = 2


@dataclass
class BatchEntry:
    """One sequence's part of a step: its new tokens from `start_pos`, its blocks, which logits."""

    token_ids: list[int]
    start_pos: int
    block_ids: list[int] | np.ndarray
    logits: str = "last"  # "none" | "last" | "all" (prompt logprobs)
    # >= 0: the last token is still being sampled by the step in flight (async scheduling);
    # its id is row `patch_row` of that step's sampled tokens, read on the device
    patch_row: int = -1
    lora_slot: int = -1  # the device slot of its LoRA adapter (-1: the base model)


@dataclass(frozen=True)
class StepHeader:
    """The sizes of one packed step (all ints, so it travels as a fixed-length array)."""

    command: int
    num_tokens: int
    num_seqs: int
    max_blocks: int
    num_patched: int
    num_rows: int  # logits rows; == num_tokens: every row, in order (no gather)
    num_copies: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_prev_tokens: int  # length of the sampled-token tensor the patches read
    # the sequences after the decodes up to the last one with a cached prefix: the prefill
    # kernel that reads prefixes takes these, the no-prefix kernel the ones after them
    prefixed_prefills: int

    @classmethod
    def stop(cls) -> StepHeader:
        return cls(STOP, *([0] * (len(fields(cls)) - 1)))

    @classmethod
    def load_kv(cls) -> StepHeader:
        return cls(LOAD_KV, *([0] * (len(fields(cls)) - 1)))

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.int64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> StepHeader:
        return cls(*values.tolist())

    @classmethod
    def empty_tensor(cls) -> torch.Tensor:
        return torch.zeros(len(fields(cls)), dtype=torch.int64)


@dataclass(frozen=True)
class _Offsets:
    """Where each section of the buffer starts; even offsets keep device views 16-byte aligned."""

    t2: int
    n2: int
    lens: int
    order: int
    tables: int
    patches: int
    rows: int
    copies: int
    size: int

    @classmethod
    def of(cls, h: StepHeader) -> _Offsets:
        t2 = h.num_tokens + h.num_tokens % 2
        n2 = h.num_seqs + 1 + (h.num_seqs + 1) % 2
        lens, order, tables = 3 * t2 + n2, 3 * t2 + 2 * n2, 3 * t2 + 3 * n2
        patches = tables + h.num_seqs * h.max_blocks
        rows = patches + 2 * h.num_patched
        copies = rows + (h.num_rows if h.num_rows < h.num_tokens else 0)
        return cls(t2, n2, lens, order, tables, patches, rows, copies,
                   copies + 2 * h.num_copies)


@dataclass
class PackedStep:
    """A step packed on the driver's host: the header and the filled buffer."""

    header: StepHeader
    host: np.ndarray  # int64, the buffer as numpy
    host_tensor: torch.Tensor  # the same memory as a tensor (pinned on CUDA)


@dataclass
class StepInputs:
    """What the model runner needs of one step, as device views of the buffer."""

    header: StepHeader
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    rows: torch.Tensor | None  # logits rows; None: every row
    patches: torch.Tensor | None  # [2, k] (flat position, sampled row) pairs
    copies: torch.Tensor | None  # [2, c] (src, dst) blocks to copy before the step


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """Gives the decode rows' launch order for the decode attention kernel: longest context
    first (ties in row order), so that a long sequence does not run on alone at the end."""
    return np.argsort(-seq_lens, kind="stable")


def pack_step(entries: list[BatchEntry], copies: list[tuple[int, int]], block_size: int,
              staging: StagingBuffer, num_prev_tokens: int = 0) -> PackedStep:
    """Gives the step of `entries` (and block copies) packed into the staging buffer;
    `num_prev_tokens` is the length of the in-flight step's sampled tokens."""
    bs, n = block_size, len(entries)
    query_lens = np.fromiter((len(e.token_ids) for e in entries), dtype=np.int64, count=n)
    starts = np.fromiter((e.start_pos for e in entries), dtype=np.int64, count=n)
    seq_lens = starts + query_lens
    total = int(query_lens.sum())
    num_blocks = np.fromiter((len(e.block_ids) for e in entries), dtype=np.int64, count=n)
    max_blocks = int(num_blocks.max())
    patched = [i for i, e in enumerate(entries) if e.patch_row >= 0]
    # cumulative query lengths, needed for the logits rows before the buffer exists
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    rows: list[int] = []
    for i, e in enumerate(entries):
        if e.logits == "last":
            rows.append(int(qsl[i + 1]) - 1)
        elif e.logits == "all":
            rows.extend(range(int(qsl[i]), int(qsl[i + 1])))
    num_decodes = int(np.argmax(query_lens != 1)) if (query_lens != 1).any() else n
    prefixed = np.flatnonzero(starts[num_decodes:])
    header = StepHeader(STEP, total, n, max_blocks, len(patched), len(rows), len(copies),
                        int(query_lens.max()), int(seq_lens.max()), num_decodes,
                        num_prev_tokens, int(prefixed[-1]) + 1 if prefixed.size else 0)
    at = _Offsets.of(header)
    host, host_tensor = staging.host(at.size)
    t2 = at.t2
    ids, positions, slots = host[:total], host[t2:t2 + total], host[2 * t2:2 * t2 + total]
    host[3 * t2:3 * t2 + n + 1] = qsl
    host[at.lens:at.lens + n] = seq_lens
    host[at.order:at.order + num_decodes] = longest_first(seq_lens[:num_decodes])
    tables = host[at.tables:at.patches].reshape(n, max_blocks)
    tables.fill(-1)
    tables[np.arange(max_blocks) < num_blocks[:, None]] = np.concatenate(
        [e.block_ids for e in entries])
    if total == n:  # a decode step: one token per sequence, at position start
        seq_of_token = np.arange(n)
        positions[:] = starts
        ids[:] = np.fromiter((e.token_ids[0] for e in entries), dtype=np.int64, count=n)
    else:
        seq_of_token = np.repeat(np.arange(n), query_lens)
        positions[:] = np.arange(total) - qsl[:-1][seq_of_token] + starts[seq_of_token]
        ids[:] = np.fromiter(itertools.chain.from_iterable(e.token_ids for e in entries),
                             dtype=np.int64, count=total)
    slots[:] = tables[seq_of_token, positions // bs] * bs + positions % bs
    if patched:  # (flat position, sampled row) pairs of the tokens still being sampled
        pairs = host[at.patches:at.rows].reshape(2, len(patched))
        pairs[0] = qsl[1:][patched] - 1
        pairs[1] = [entries[i].patch_row for i in patched]
    if at.copies > at.rows:
        host[at.rows:at.copies] = rows
    if copies:
        host[at.copies:at.size].reshape(2, len(copies))[:] = np.array(copies, dtype=np.int64).T
    return PackedStep(header, host, host_tensor)


def unpack_step(header: StepHeader, buf: torch.Tensor, host: np.ndarray | None) -> StepInputs:
    """Gives device views of a step's buffer `buf`; `host` (its host copy, when this rank
    has one) gives the attention backends the lengths without a device sync."""
    h, at = header, _Offsets.of(header)
    n, total, t2 = h.num_seqs, h.num_tokens, at.t2
    i32 = torch.int32
    qsl = buf[3 * t2:3 * t2 + n + 1]
    meta = AttentionMetadata(
        slot_mapping=buf[2 * t2:2 * t2 + total],
        query_start_loc=qsl.to(i32),
        seq_lens=buf[at.lens:at.lens + n].to(i32),
        block_tables=buf[at.tables:at.patches].view(n, h.max_blocks).to(i32),
        max_query_len=h.max_query_len,
        max_seq_len=h.max_seq_len,
        num_decode_tokens=h.num_decodes,
        decode_order=buf[at.order:at.order + h.num_decodes] if h.num_decodes else None,
        query_lens_cpu=None if host is None else np.diff(host[3 * t2:3 * t2 + n + 1]).tolist(),
        seq_lens_cpu=None if host is None else host[at.lens:at.lens + n].tolist(),
        prefixed_prefills=h.prefixed_prefills,  # from the header: every rank knows it
    )
    return StepInputs(
        header=h, input_ids=buf[:total], positions=buf[t2:t2 + total], meta=meta,
        rows=None if h.num_rows == h.num_tokens else buf[at.rows:at.copies],
        patches=buf[at.patches:at.rows].view(2, h.num_patched) if h.num_patched else None,
        copies=buf[at.copies:at.size].view(2, h.num_copies) if h.num_copies else None)


def buffer_size(header: StepHeader) -> int:
    """Gives the int64 elements of a step's buffer (what a worker allocates to receive it)."""
    return _Offsets.of(header).size
