"""The wire checksum of many KV blocks at once, computed where the blocks are."""

from __future__ import annotations

import torch

from kvpilot.engine.contracts.kv_protocol import CHECKSUM_MODULUS

CHECKSUM_PIECE_BYTES = 64 * 2**20  # data summed per piece: bounds the int32 temporaries


def block_checksums(data: torch.Tensor) -> torch.Tensor:
    """Gives [n, 2] int64 (plain, weighted) sums of each row of a uint8 [n, bytes] tensor,
    on its device: `protocol.checksum`'s two sums (low 32 bits), for many blocks at once.

    On CUDA one Triton kernel reads the data once (it runs beside decode steps on the
    same GPU); elsewhere a few torch ops per 64 MiB piece.
    """
    if data.is_cuda:
        from kvpilot.kernels.block_checksum import block_checksums_triton

        return block_checksums_triton(data, CHECKSUM_MODULUS)
    rows, size = data.shape
    words = data.view(torch.int16)
    weights = (torch.arange(size // 2, dtype=torch.int32, device=data.device)
               % CHECKSUM_MODULUS + 1)
    out = torch.empty((rows, 2), dtype=torch.int64, device=data.device)
    step = max(1, CHECKSUM_PIECE_BYTES // max(size, 1))
    for first in range(0, rows, step):
        piece = words[first:first + step].to(torch.int32) & 0xFFFF
        out[first:first + step, 0] = piece.sum(1, dtype=torch.int64)
        out[first:first + step, 1] = (piece * weights).sum(1, dtype=torch.int64)
    return out
