"""Where a prefill engine's KV blocks sit in its memory, and the NIXL descriptor lists that
read them into wire-layout rows on the decode side (pure: numpy only, no NIXL, no torch).

Two sources: the per-layer caches themselves (`read_descriptors`: one descriptor per
block, layer and K/V, a few tens of KiB each), or the prefill engine's send region
(`region_descriptors`), wire-layout rows it packs a pull's blocks into on its device,
read one descriptor per run of consecutive rows. Per-descriptor cost dominates small
pieces (about 9 µs each over UCX cuda_ipc on H100s: 3.5 GB/s for 32 KiB pieces, 357 GB/s
for one 256 MiB piece, bench/nixl_probe_gpu.py), hence the region.

A prefill engine's cache is one tensor per layer, [2, num_blocks, block_size,
num_kv_heads, head_dim], contiguous: the K (or V) data of one block in one layer
is one contiguous `piece_bytes` slice. A block on the wire (and in a receive
buffer row) is every layer's K and V, layer-major, so piece (layer, kv) of a
block goes to offset (layer * 2 + kv) * piece_bytes of its row. One READ moves a
whole group: blocks x layers x 2 descriptors on each side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpilot.engine.contracts.kv_protocol import ProtocolError

MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class CacheLayout:
    """A prefill engine's registered KV caches, as the decode side needs them to read."""

    mem: str  # "DRAM" (CPU engine) or "VRAM"
    device: int  # the GPU index for VRAM, 0 for DRAM
    cache_ptrs: tuple[int, ...]  # each layer's cache base address
    num_blocks: int  # blocks per layer cache
    piece_bytes: int  # one block's K (or V) of one layer
    region_ptr: int = 0  # the send region's base address (0: no region)
    region_rows: int = 0  # its rows, `block_bytes` each

    @property
    def block_bytes(self) -> int:
        """Gives one block's size on the wire: every layer's K and V."""
        return len(self.cache_ptrs) * 2 * self.piece_bytes

    def to_message(self) -> dict[str, Any]:
        """Gives the layout as the JSON a LEASE frame carries."""
        return {"mem": self.mem, "device": self.device, "cache_ptrs": list(self.cache_ptrs),
                "num_blocks": self.num_blocks, "piece_bytes": self.piece_bytes,
                "region_ptr": self.region_ptr, "region_rows": self.region_rows}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> CacheLayout:
        """Gives the layout a peer sent, or raises ProtocolError naming the bad field."""
        try:
            layout = cls(str(message["mem"]), int(message["device"]),
                         tuple(int(p) for p in message["cache_ptrs"]),
                         int(message["num_blocks"]), int(message["piece_bytes"]),
                         int(message.get("region_ptr", 0)), int(message.get("region_rows", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"the peer's NIXL cache layout is malformed: {exc!r}") from exc
        if layout.mem not in MEM_TYPES:
            raise ProtocolError(f"the peer's NIXL cache layout has mem={layout.mem!r}: "
                                f"expected one of {', '.join(MEM_TYPES)}")
        if not layout.cache_ptrs or layout.num_blocks <= 0 or layout.piece_bytes <= 0:
            raise ProtocolError(f"the peer's NIXL cache layout is empty: {message!r}")
        return layout


def read_descriptors(layout: CacheLayout, block_ids: list[int], row_ptrs: list[int],
                     local_device: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gives (local, remote) Nx3 uint64 descriptor arrays (address, length, device) that
    read block `block_ids[i]` of the peer's caches into the wire-layout row at
    `row_ptrs[i]` (on GPU `local_device`, or host memory: 0)."""
    if len(block_ids) != len(row_ptrs):
        raise ValueError(f"{len(block_ids)} block ids for {len(row_ptrs)} rows")
    bad = [b for b in block_ids if not 0 <= b < layout.num_blocks]
    if bad:
        raise ProtocolError(f"the peer named block ids {bad[:4]} outside its "
                            f"{layout.num_blocks}-block cache")
    piece = layout.piece_bytes
    layers = np.asarray(layout.cache_ptrs, dtype=np.uint64)
    blocks = np.asarray(block_ids, dtype=np.uint64)
    rows = np.asarray(row_ptrs, dtype=np.uint64)
    kv = np.arange(2, dtype=np.uint64)
    # [blocks, layers, 2]: the order of the pieces in a row
    remote = (layers[None, :, None]
              + (kv[None, None, :] * np.uint64(layout.num_blocks) + blocks[:, None, None])
              * np.uint64(piece))
    offsets = np.arange(len(layers) * 2, dtype=np.uint64).reshape(len(layers), 2)
    local = rows[:, None, None] + offsets[None] * np.uint64(piece)
    lengths = np.full(remote.size, piece, dtype=np.uint64)
    return (_descriptors(local.reshape(-1), lengths, local_device),
            _descriptors(remote.reshape(-1), lengths, layout.device))


def region_descriptors(layout: CacheLayout, remote_rows: list[int], local_base: int,
                       local_rows: list[int], local_device: int = 0
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Gives (local, remote) Nx3 uint64 descriptor arrays that read row `remote_rows[i]` of
    the peer's send region into row `local_rows[i]` of the rows at `local_base`: one
    descriptor per run where both sides' rows go up by one."""
    if len(remote_rows) != len(local_rows):
        raise ValueError(f"{len(remote_rows)} region rows for {len(local_rows)} local rows")
    bad = [r for r in remote_rows if not 0 <= r < layout.region_rows]
    if bad:
        raise ProtocolError(f"the peer named rows {bad[:4]} outside its "
                            f"{layout.region_rows}-row send region")
    size = layout.block_bytes
    runs: list[list[int]] = []  # [first remote row, first local row, count]
    for remote, local in zip(remote_rows, local_rows, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == remote and runs[-1][1] + runs[-1][2] == local:
            runs[-1][2] += 1
        else:
            runs.append([remote, local, 1])
    table = np.asarray(runs, dtype=np.uint64).reshape(-1, 3) * np.uint64(size)
    return (_descriptors(np.uint64(local_base) + table[:, 1], table[:, 2], local_device),
            _descriptors(np.uint64(layout.region_ptr) + table[:, 0], table[:, 2],
                         layout.device))


def _descriptors(addresses: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    """Gives the Nx3 uint64 (address, length, device) array NIXL takes."""
    return np.stack([addresses, lengths, np.full(len(addresses), device, np.uint64)], axis=1)
