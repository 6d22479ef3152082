"""KV blocks in host memory by content hash: a bounded pool of rows, LRU, with checksums.

A row holds one block in the wire layout of `kv_transfer.engine_store` ([num_layers, 2,
block_size, num_kv_heads, head_dim] in the cache dtype, as bytes) and the block's two
checksum sums (`kv_transfer.block_checksums`), checked when the block goes back to the
device. Rows are allocated once (pinned on CUDA: pinning memory mid-serving stalls the
engine beside it). A full pool evicts its least recently used entry that no load has
pinned; when every entry is pinned, a store is dropped (the block is recomputed later).

Thread-safe: the engine thread stores evicted blocks and pins blocks to load; a decode
engine's KV agent stores pulled blocks from its own thread. Every method takes `lock`,
never the engine's. The engine thread publishes the pool's changes as KV events
(`take_events`), so the router knows which blocks an engine holds in host memory.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class HostPoolStats:
    """Cumulative counters of a host pool, in blocks."""

    stored: int = 0  # blocks written into the pool
    evicted: int = 0  # entries dropped to make room (LRU)
    dropped: int = 0  # stores refused: every entry was pinned by a load


class HostKVPool:
    """At most `num_blocks` KV blocks of `block_bytes` each in host memory, by hash."""

    def __init__(self, num_blocks: int, block_bytes: int, pin_memory: bool,
                 device: torch.device | str = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError(f"kv_offload_gb holds num_blocks={num_blocks} blocks of "
                             f"{block_bytes} bytes: raise --kv-offload-gb to hold at least one")
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        # rows on a GPU: a NIXL decode engine's landing pool (see host_tier.make_host_tier)
        pin_memory = pin_memory and torch.device(device).type == "cpu"
        self.data = torch.empty((num_blocks, block_bytes), dtype=torch.uint8, device=device,
                                pin_memory=pin_memory)
        # [num_blocks, 2] (plain, weighted) sums, low 32 bits, of each row's data
        self.sums = torch.zeros((num_blocks, 2), dtype=torch.int64, device=device,
                                pin_memory=pin_memory)
        self.lock = threading.Lock()
        self._rows: OrderedDict[int, int] = OrderedDict()  # hash -> row, least recent first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pins: Counter[int] = Counter()  # row -> loads that will read it
        self._events: list[tuple[bool, int]] = []  # (stored?, hash) not yet published
        self.stats = HostPoolStats()

    @property
    def usage(self) -> float:
        """Gives the fraction of rows holding a block, 0..1."""
        with self.lock:
            return len(self._rows) / self.num_blocks

    def __contains__(self, block_hash: int) -> bool:
        with self.lock:
            return block_hash in self._rows

    def num_cached_prefix(self, hashes: Sequence[int]) -> int:
        """Gives how many leading hashes the pool holds."""
        with self.lock:
            count = 0
            for block_hash in hashes:
                if block_hash not in self._rows:
                    break
                count += 1
            return count

    def allocate(self, hashes: Sequence[int]) -> list[tuple[int, int]]:
        """Gives (hash, row) for each hash not held yet, in order, as far as room goes.

        Held hashes are touched (most recent). Rows come from free ones, then from the
        least recently used unpinned entries; a hash with no row left is counted as
        dropped. The caller writes each row and then `commit`s it (or `abandon`s it).
        """
        out: list[tuple[int, int]] = []
        with self.lock:
            for block_hash in hashes:
                if block_hash in self._rows:
                    self._rows.move_to_end(block_hash)
                    continue
                row = self._take_row()
                if row is None:
                    self.stats.dropped += 1
                    continue
                out.append((block_hash, row))
        return out

    def _take_row(self) -> int | None:
        if self._free:
            return self._free.pop()
        for victim, row in self._rows.items():
            if not self._pins[row]:
                del self._rows[victim]
                self._events.append((False, victim))
                self.stats.evicted += 1
                return row
        return None

    def commit(self, entries: Sequence[tuple[int, int]]) -> None:
        """Makes written rows findable under their hashes (a hash stored meanwhile keeps
        its first row; the duplicate row goes back)."""
        with self.lock:
            for block_hash, row in entries:
                if block_hash in self._rows:
                    self._free.append(row)
                    continue
                self._rows[block_hash] = row
                self._events.append((True, block_hash))
                self.stats.stored += 1

    def abandon(self, rows: Sequence[int]) -> None:
        """Gives rows from `allocate` back unwritten."""
        with self.lock:
            self._free.extend(rows)

    def pin(self, hashes: Sequence[int]) -> list[int]:
        """Gives the rows of the leading held hashes, pinned until `unpin` (a load reads them)."""
        rows: list[int] = []
        with self.lock:
            for block_hash in hashes:
                row = self._rows.get(block_hash)
                if row is None:
                    break
                self._rows.move_to_end(block_hash)
                self._pins[row] += 1
                rows.append(row)
        return rows

    def unpin(self, rows: Sequence[int]) -> None:
        with self.lock:
            for row in rows:
                self._pins[row] -= 1
                if self._pins[row] <= 0:
                    del self._pins[row]

    def discard(self, hashes: Sequence[int]) -> None:
        """Forgets entries whose data failed its checksum; call once the loads that read
        them have run (their rows are written again)."""
        with self.lock:
            for block_hash in hashes:
                row = self._rows.pop(block_hash, None)
                if row is not None:
                    self._events.append((False, block_hash))
                    self._free.append(row)

    def take_events(self) -> list[tuple[bool, int]]:
        """Gives the (stored?, hash) changes since the last call, oldest first."""
        with self.lock:
            events, self._events = self._events, []
        return events
