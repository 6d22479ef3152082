"""A BlockStore over plain dicts: blocks by hash, pin counts, a capacity.

pyright checks it against the protocol (see the end of the file).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.contracts.kv_protocol import ProtocolError, checksum

if TYPE_CHECKING:
    from kvpilot.engine.kv_transfer.connector import BlockStore

BLOCK_SIZE = 4


def block_data(block_hash: int, size: int) -> bytes:
    """Gives deterministic block contents derived from the hash."""
    return (block_hash.to_bytes(8, "little") * (size // 8 + 1))[:size]


class FakeStore:
    """Cached blocks by hash (their data), pins by hash, at most `capacity` blocks."""

    def __init__(self, block_bytes: int = 64, capacity: int = 1000) -> None:
        self.lock = threading.RLock()
        self.block_bytes = block_bytes
        self.read_chunk_blocks = 32
        self.receive_chunk_blocks = 3  # several groups per pull of the 10-block prompts
        self.capacity = capacity
        self.blocks: dict[int, bytes] = {}
        self.pins: dict[int, int] = {}

    def compute(self, token_ids: Sequence[int]) -> list[int]:
        """Plays a prefill: caches the prompt's full blocks; gives their hashes."""
        hashes = hash_prompt_blocks(list(token_ids), BLOCK_SIZE)
        for h in hashes:
            self.blocks[h] = block_data(h, self.block_bytes)
        return hashes

    @property
    def pinned(self) -> int:
        return sum(self.pins.values())

    def owned_blocks(self) -> int:
        return len(self.pins)

    def pin(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        hashes = []
        for h in hash_prompt_blocks(list(token_ids), BLOCK_SIZE):
            if h not in self.blocks:
                break
            hashes.append(h)
            self.pins[h] = self.pins.get(h, 0) + 1
        return hashes, list(hashes)

    def unpin(self, handle: list[int]) -> None:
        for h in handle:
            self.pins[h] -= 1
            assert self.pins[h] >= 0
            if not self.pins[h]:
                del self.pins[h]

    def read(self, handle: list[int], hashes: Sequence[int]) -> FakeRead:
        assert set(hashes) <= set(handle), "read of an unpinned block"
        return FakeRead([self.blocks[h] for h in hashes])

    def slots(self, handle: list[int], hashes: Sequence[int],
              out: object = None) -> tuple[list[int], list[bytes]]:
        raise AssertionError("the fake store registers nothing with NIXL: its pulls go by TCP")

    def num_cached_prefix(self, hashes: Sequence[int]) -> int:
        count = 0
        for h in hashes:
            if h not in self.blocks:
                break
            count += 1
        return count

    def receive_buffer(self, timeout: float) -> FakeBuffer:
        return FakeBuffer(self.receive_chunk_blocks, self.block_bytes)

    def stage(self, buffer: FakeBuffer, hashes: Sequence[int]) -> FakeStaged:
        return FakeStaged([(h, bytes(buffer.block(i))) for i, h in enumerate(hashes)])

    def verify(self, staged: FakeStaged, digests: Sequence[bytes]) -> None:
        for (block_hash, data), digest in zip(staged.blocks, digests, strict=True):
            if checksum(data) != digest:
                raise ProtocolError(f"checksum mismatch on block {block_hash:#x}")

    def import_blocks(self, staged: FakeStaged, prefix_hashes: Sequence[int] = ()) -> int:
        room = self.capacity - len(self.blocks)
        new = [(h, d) for h, d in staged.blocks if h not in self.blocks][:max(room, 0)]
        self.blocks.update(new)
        return len(new)


class FakeRead:
    """Data that is ready at once."""

    def __init__(self, data: list[bytes]) -> None:
        self.data = data

    def wait(self) -> list[memoryview]:
        return [memoryview(d) for d in self.data]

    def checksums(self) -> list[bytes]:
        return [checksum(d) for d in self.data]

    def release(self) -> None:
        pass


class FakeBuffer:
    """A bytearray of `capacity` blocks (`tensor` views the same bytes, as NIXL would read)."""

    def __init__(self, capacity: int, block_bytes: int) -> None:
        self.capacity = capacity
        self.data, self.size = bytearray(capacity * block_bytes), block_bytes
        self.tensor = torch.frombuffer(self.data, dtype=torch.uint8).view(capacity, block_bytes) \
            if capacity else torch.empty(0, block_bytes, dtype=torch.uint8)

    def block(self, index: int) -> memoryview:
        return memoryview(self.data)[index * self.size:(index + 1) * self.size]

    def release(self) -> None:
        pass


class FakeStaged:
    def __init__(self, blocks: list[tuple[int, bytes]]) -> None:
        self.blocks = blocks

    def wait(self) -> None:
        pass


if TYPE_CHECKING:  # the connector's tests run against FakeStore as against an engine's store
    _: BlockStore[list[int], FakeBuffer, FakeStaged] = FakeStore()
