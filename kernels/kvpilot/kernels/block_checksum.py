"""Per-block checksums of KV blocks in one pass over the data.

The KV transfer's checksum field (`engine/kv_transfer/protocol.py: checksum`) is two
sums over a block's little-endian 16-bit words: their plain sum and their sum
weighted by position (weights 1..MODULUS, repeating), each mod 2**32. Built from
torch ops they take five passes over int32 copies of the data (about 16 bytes
of traffic per byte summed), on the GPU that also runs decode steps; here each
program reads its slice of one block once and writes two int64 partial sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit

SPLITS = 8  # programs per block: rows are few (a chunk is <= 256 blocks) and long (MiBs)
TILE = 2048  # 16-bit words each program loads per iteration


@jit
def _block_checksum_kernel(words_ptr, out_ptr, words_per_row, words_per_split,
                           MODULUS: tl.constexpr, SPLITS: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    first = split * words_per_split
    end = tl.minimum(first + words_per_split, words_per_row)
    base = words_ptr + row.to(tl.int64) * words_per_row
    plain = tl.zeros([TILE], dtype=tl.int64)
    weighted = tl.zeros([TILE], dtype=tl.int64)
    for start in range(first, end, TILE):
        index = start + tl.arange(0, TILE)
        mask = index < end
        word = tl.load(base + index, mask=mask, other=0).to(tl.int32) & 0xFFFF
        # word * weight < 65536 * MODULUS < 2**31: exact in int32 before widening
        weight = index % MODULUS + 1
        plain += word.to(tl.int64)
        weighted += (word * weight).to(tl.int64)
    out = out_ptr + (row * SPLITS + split) * 2
    tl.store(out, tl.sum(plain, 0))
    tl.store(out + 1, tl.sum(weighted, 0))


def block_checksums_triton(data: torch.Tensor, modulus: int) -> torch.Tensor:
    """Gives [n, 2] int64 (plain, weighted) sums of each row of a contiguous uint8 [n, bytes]
    tensor (bytes even), mod 2**64: the caller keeps the low 32 bits of each."""
    rows, size = data.shape
    words = data.view(torch.int16)
    per_row = size // 2
    per_split = triton.cdiv(triton.cdiv(per_row, SPLITS), TILE) * TILE
    partial = torch.empty((rows, SPLITS, 2), dtype=torch.int64, device=data.device)
    if rows:
        _block_checksum_kernel[(rows, SPLITS)](words, partial, per_row, per_split,
                                               MODULUS=modulus, SPLITS=SPLITS, TILE=TILE)
    return partial.sum(1)
