"""A prefill engine's NIXL send region: wire-layout rows on its device that a pull's blocks
are packed into, so the decode side READs a few large descriptors instead of one per
block, layer and K/V (see `nixl_layout`).

The rows are allocated and registered once, beside the KV caches; a pull takes a run of
consecutive rows (first fit) for its wanted blocks, the store gathers the blocks into it
with their checksums (`EngineBlockStore.slots`), and the rows come back at the pull's
RELEASE or when its conversation ends. A pull that finds no room within `ROOM_WAIT_S`, or
wants more rows than the region has, is read from the caches directly (slower, correct).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOM_WAIT_S = 1.0  # how long a pull waits for rows that other pulls hold


class SendRegion:
    """`rows` (uint8 [num_rows, block_bytes], registered with NIXL) and their allocator."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        self.num_rows = rows.shape[0]
        self._free: list[tuple[int, int]] = [(0, self.num_rows)]  # (first, count), by first
        self._room = threading.Condition()

    def take(self, count: int, wait_s: float | None = None) -> int | None:
        """Gives the first of `count` consecutive free rows, now taken, or None when the
        region is smaller than `count` or no run frees up within `wait_s` seconds (default
        ROOM_WAIT_S)."""
        if not 0 < count <= self.num_rows:
            return None
        deadline = time.monotonic() + (ROOM_WAIT_S if wait_s is None else wait_s)
        with self._room:
            while True:
                for index, (first, free) in enumerate(self._free):
                    if free >= count:
                        if free == count:
                            del self._free[index]
                        else:
                            self._free[index] = (first + count, free - count)
                        return first
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._room.wait(left)

    def give(self, first: int, count: int) -> None:
        """Gives rows `first`..`first + count - 1` back (merged with free neighbours)."""
        with self._room:
            self._free.append((first, count))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, size in self._free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((start, size))
            self._free = merged
            self._room.notify_all()

    @contextmanager
    def rows_for(self, count: int) -> Iterator[tuple[int, torch.Tensor] | None]:
        """Holds `count` consecutive rows while the block runs: gives (first row, the rows),
        or None when `take` finds no room; gives them back after."""
        first = self.take(count)
        try:
            yield None if first is None else (first, self.rows[first:first + count])
        finally:
            if first is not None:
                self.give(first, count)

    @property
    def free_rows(self) -> int:
        with self._room:
            return sum(count for _, count in self._free)
