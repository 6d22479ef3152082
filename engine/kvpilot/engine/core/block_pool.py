"""The pool of KV-cache blocks: ref counts, an LRU of free blocks, and the prefix-hash map.

A block is either owned (``ref_cnt > 0``) or in the free queue, never both. A
freed block that was full keeps its hash: it stays findable through the hash
map until it is handed out again as a new block, which evicts it. The free
queue is ordered oldest-freed first, so the blocks reused least recently are
evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.engine.core.kv_events import DEFAULT_CAPACITY, KVEventLog


@dataclass
class KVCacheBlock:
    """One block of `block_size` token slots in every layer's KV tensor."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """Hands out and takes back blocks; finds cached full blocks by their hash."""

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 event_capacity: int = DEFAULT_CAPACITY) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: the KV cache needs at least "
                             "one block; raise kv_cache_memory or num_kv_blocks")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, oldest-freed first; OrderedDict gives O(1) removal on a hit
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}
        # what the router polls (GET /kv_events): hashes cached and evicted, in order
        self.events = KVEventLog(event_capacity)
        # hears (block_id, hash) of each cached block evicted, before the block is handed out
        # (a host-memory tier copies it out: `kv_connector.host_tier`)
        self.on_evict: Callable[[int, int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Gives the fraction of blocks owned by some sequence, 0..1."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def allocate(self, count: int) -> list[KVCacheBlock]:
        """Gives `count` fresh blocks with ref_cnt 1, evicting cached ones; raises if short."""
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks with {len(self.free_queue)} free")
        out = []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: int) -> KVCacheBlock | None:
        """Gives the cached block holding `block_hash`'s contents, if any."""
        return self.cached.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Takes one more reference on each block (a prefix hit or a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drops one reference from each block; blocks reaching zero join the free queue's tail.

        Callers pass a sequence's blocks last-first, so a sequence's tail blocks
        (the least shareable) are evicted before its prefix.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache(self, block: KVCacheBlock, block_hash: int) -> None:
        """Registers a full block under its content hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self.events.stored(block_hash)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self.events.removed(block.block_hash)
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (owned blocks keep their data, just not findable)."""
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self.events.cleared()
