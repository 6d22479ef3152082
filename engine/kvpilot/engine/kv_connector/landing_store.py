"""The block store a decode engine's KV agent pulls into: its host tier, not its GPU cache
(on a GPU with --kv-transport nixl and no host tier, a pool of the same kind in device
memory: NIXL moves GPU to GPU at NVLink speed but to host memory at under 1 GB/s here).

Pulled blocks land in the engine's `HostKVPool` under their hashes, from the agent's
thread, without the engine lock; the request the router sends next finds them
through the connector's scheduler side and the step loads them (`host_tier`). The
frame checksums are stored with the rows and checked on the device when a block
is loaded, so a corrupted block is recomputed there, never read.

A decode engine leases nothing: `pin` gives no blocks, so a FETCH to it finds no lease.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvpilot.engine.contracts.kv_protocol import ProtocolError
from kvpilot.engine.core.block_pool import BlockPool
from kvpilot.engine.kv_connector.host_pool import HostKVPool
from kvpilot.engine.kv_transfer.connector import PendingRead
from kvpilot.engine.kv_transfer.engine_store import (
    READ_BUFFER_MAX_BLOCKS,
    RECEIVE_BUFFER_BYTES,
    RECEIVE_BUFFERS,
)
from kvpilot.engine.kv_transfer.host_buffers import BufferPool, ReceiveBuffer


class Landed:
    """Received blocks (uint8 [n, block_bytes] rows of a receive buffer) and their sums."""

    def __init__(self, hashes: list[int], data: torch.Tensor) -> None:
        self.hashes, self.data = hashes, data
        self.sums: torch.Tensor | None = None  # [n, 2] from the frames' checksum fields

    def wait(self) -> None:
        """Returns at once: the rows are copied into the pool by `import_blocks` itself."""


class LandingStore:
    """Receives pulled blocks into a host pool; reads the GPU cache's hash map only to skip
    blocks the engine already holds (a dict lookup from another thread: a block evicted
    meanwhile is recomputed, never read wrongly)."""

    read_chunk_blocks = 1  # never read: a decode engine serves no leases

    def __init__(self, host: HostKVPool, gpu: BlockPool, pin_memory: bool) -> None:
        self.host, self.pool = host, gpu  # `pool`: the GPU cache's, as EngineBlockStore names it
        self.block_bytes = host.block_bytes
        self._pin_memory = pin_memory
        self.receive_chunk_blocks = max(1, min(READ_BUFFER_MAX_BLOCKS,
                                               RECEIVE_BUFFER_BYTES // self.block_bytes))
        self.receive_buffers = BufferPool(self._new_receive_buffer, RECEIVE_BUFFERS)
        self._lock = threading.RLock()  # the agent's own: the engine never takes it

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def pin(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        return [], []

    def unpin(self, handle: list[int]) -> None:
        """Drops nothing: `pin` pins nothing."""

    def read(self, handle: list[int], hashes: Sequence[int]) -> PendingRead:
        raise ProtocolError("a decode engine serves no leases: pull from the prefill engine")

    def slots(self, handle: list[int], hashes: Sequence[int],
              out: torch.Tensor | None = None) -> tuple[list[int], list[bytes]]:
        raise ProtocolError("a decode engine serves no leases: pull from the prefill engine")

    def owned_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def num_cached_prefix(self, hashes: Sequence[int]) -> int:
        """Gives how many leading hashes the GPU cache or the host pool holds."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self.pool.cached and block_hash not in self.host:
                break
            count += 1
        return count

    def receive_buffer(self, timeout: float) -> ReceiveBuffer:
        return self.receive_buffers.get(timeout)

    def _new_receive_buffer(self, pool: BufferPool[ReceiveBuffer]) -> ReceiveBuffer:
        return ReceiveBuffer(torch.empty((self.receive_chunk_blocks, self.block_bytes),
                                         dtype=torch.uint8, pin_memory=self._pin_memory), pool)

    def stage(self, buffer: ReceiveBuffer, hashes: Sequence[int]) -> Landed:
        return Landed(list(hashes), buffer.tensor[:len(hashes)])

    def verify(self, staged: Landed, digests: Sequence[bytes]) -> None:
        """Keeps the frames' checksums with the blocks: the load checks them on the device."""
        raw = torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.int32)
        staged.sums = raw.view(-1, 2).to(torch.int64) & 0xFFFFFFFF

    def reserve(self, hashes: Sequence[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Gives the host pool's rows (uint8 [num_rows, block_bytes]) and (hash, row) for each
        hash it does not hold, as far as room goes: a NIXL READ writes them in place, then
        `land` or `abandon` them (no receive buffer, no copy)."""
        return self.host.data, self.host.allocate(hashes)

    def land(self, entries: list[tuple[int, int]], digests: Sequence[bytes]) -> None:
        """Makes reserved rows, now written, findable with their checksums (checked on the
        device when a step loads them)."""
        if entries:
            raw = torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.int32)
            rows = torch.tensor([row for _, row in entries])
            sums = raw.view(-1, 2).to(torch.int64) & 0xFFFFFFFF
            self.host.sums[rows] = sums.to(self.host.sums.device)
            self.host.commit(entries)

    def abandon(self, entries: list[tuple[int, int]]) -> None:
        """Gives reserved rows back unwritten (or half-written: never findable)."""
        self.host.abandon([row for _, row in entries])

    def import_blocks(self, staged: Landed, prefix_hashes: Sequence[int] = ()) -> int:
        """Copies the blocks the host pool takes into its rows; gives how many went in."""
        if staged.sums is None:
            raise ProtocolError("import_blocks before verify: the blocks have no checksums")
        entries = self.host.allocate(staged.hashes)
        if entries:
            index = {h: i for i, h in enumerate(staged.hashes)}
            source = torch.tensor([index[h] for h, _ in entries])
            rows = torch.tensor([row for _, row in entries])
            self.host.data[rows] = staged.data[source].to(self.host.data.device)
            self.host.sums[rows] = staged.sums[source].to(self.host.sums.device)
            self.host.commit(entries)
        return len(entries)
