"""The BlockStore over a running LLMEngine: its block pool and per-layer KV tensors.

A block's data on the wire is every layer's K and V for that block, layer-major:
[num_layers, 2, block_size, num_kv_heads, head_dim] in the cache dtype, copied
through host memory so CPU and GPU engines interoperate.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvpilot.engine.block_hash import hash_prompt_blocks
from kvpilot.engine.core.block_pool import KVCacheBlock


class EngineBlockStore:
    """Pins, reads and imports blocks of one engine by content hash."""

    def __init__(self, engine: Any) -> None:
        self.pool = engine.kv.pool
        self.caches: list[torch.Tensor] = engine.runner.kv_caches
        self.block_size: int = engine.engine_args.block_size
        self.block_bytes: int = engine.runner.bytes_per_block
        self.lock = threading.RLock()
        first = self.caches[0]
        self._shape = (len(self.caches), 2, *first.shape[2:])
        self._dtype = first.dtype

    def pin(self, token_ids: Sequence[int]) -> tuple[list[int], list[KVCacheBlock]]:
        """Gives (hashes, blocks) of the prompt's cached leading full blocks, now pinned."""
        hashes = hash_prompt_blocks(list(token_ids), self.block_size)
        blocks = self._cached_prefix(hashes)
        self.pool.touch(blocks)
        return hashes[:len(blocks)], blocks

    def _cached_prefix(self, hashes: Sequence[int]) -> list[KVCacheBlock]:
        """Gives the cached blocks of the leading hashes, up to the first miss."""
        blocks = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def unpin(self, handle: list[KVCacheBlock]) -> None:
        """Drops the pins, tail first so the prompt's head stays cached longest."""
        self.pool.free(handle[::-1])

    def read(self, handle: list[KVCacheBlock], hashes: Sequence[int]) -> list[bytes]:
        """Gives the wire data of the pinned blocks with these hashes."""
        by_hash = {b.block_hash: b for b in handle}
        out = []
        for block_hash in hashes:
            block_id = by_hash[block_hash].block_id
            data = torch.stack([cache[:, block_id] for cache in self.caches]).cpu()
            out.append(data.contiguous().view(torch.uint8).numpy().tobytes())
        return out

    def owned_blocks(self) -> int:
        """Gives how many blocks have a reference (running requests or leases)."""
        return self.pool.num_blocks - self.pool.num_free_blocks

    def num_cached_prefix(self, hashes: Sequence[int]) -> int:
        """Gives how many leading hashes the prefix cache holds."""
        return len(self._cached_prefix(hashes))

    def import_blocks(self, blocks: Sequence[tuple[int, bytes | memoryview]],
                      prefix_hashes: Sequence[int] = ()) -> int:
        """Writes blocks into free slots as cached, unowned blocks; gives how many it wrote.

        They join the free queue's tail like a finished request's blocks, so the
        request that follows finds them as prefix hits. Blocks already cached are
        skipped; when the pool is short, only the leading blocks that fit go in.
        The locally cached `prefix_hashes` are pinned meanwhile, so allocating
        room for the new blocks cannot evict the prefix they extend.
        """
        held = [b for b in (self.pool.lookup(h) for h in prefix_hashes) if b is not None]
        self.pool.touch(held)
        try:
            new = [(h, d) for h, d in blocks if self.pool.lookup(h) is None]
            new = new[:self.pool.num_free_blocks]
            if new:
                self._write(new)
        finally:
            self.pool.free(held[::-1])
        return len(new)

    def _write(self, new: list[tuple[int, bytes | memoryview]]) -> None:
        slots = self.pool.allocate(len(new))
        for slot, (block_hash, data) in zip(slots, new, strict=True):
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            tensor = tensor.view(self._dtype).view(self._shape)
            for layer, cache in enumerate(self.caches):
                cache[:, slot.block_id].copy_(tensor[layer], non_blocking=False)
            self.pool.cache(slot, block_hash)
        self.pool.free(slots[::-1])
