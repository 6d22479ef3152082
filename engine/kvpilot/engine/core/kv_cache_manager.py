"""Per-sequence block tables over the block pool: prefix lookup, slot allocation, fork, free.

The scheduler asks this manager for room and never touches blocks itself.
Prefix hits are counted in tokens, like vLLM's `prefix_cache_queries/hits`.
"""

from __future__ import annotations

import numpy as np

from kvpilot.engine.contracts.block_hash import UNSALTED, hash_block_tokens, hash_prompt_tail
from kvpilot.engine.contracts.lora import lora_root_hash
from kvpilot.engine.core.block_pool import BlockPool, KVCacheBlock
from kvpilot.engine.core.request import Sequence


def cdiv(a: int, b: int) -> int:
    """Gives ceil(a / b) for non-negative ints."""
    return -(-a // b)


class KVCacheManager:
    """Maps each sequence to its blocks and keeps the prefix cache up to date."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 cache_prompt_tails: bool = False, hash_salt: bytes = UNSALTED) -> None:
        self.block_size = block_size
        self.hash_salt = hash_salt  # the fleet's (`FleetSecret.block_hash_salt`)
        self.enable_caching = enable_caching
        # a prefill engine (--role prefill) also caches each prompt's partial last block when
        # the sequence is freed, under `hash_prompt_tail`, so a KV transfer can carry it
        self.cache_prompt_tails = cache_prompt_tails
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_tables: dict[int, list[KVCacheBlock]] = {}
        # seq_id -> the table's block ids as numpy, built on a step's first read and dropped
        # when the table changes, so steady decode steps never walk a sequence's blocks
        self._id_arrays: dict[int, np.ndarray] = {}
        self._num_hashed_blocks: dict[int, int] = {}  # full blocks already in the hash map
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, seq: Sequence) -> list[int]:
        """Gives the block ids of `seq`'s table, in position order (a copy)."""
        return [b.block_id for b in self.block_tables.get(seq.seq_id, ())]

    def block_id_array(self, seq: Sequence) -> np.ndarray:
        """Gives `seq`'s block ids as an int64 array; cached between steps, do not modify."""
        arr = self._id_arrays.get(seq.seq_id)
        if arr is None:
            arr = self._id_arrays[seq.seq_id] = np.array(self.block_ids(seq), dtype=np.int64)
        return arr

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _update_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else lora_root_hash(seq.request.lora_name)
            hashes.append(hash_block_tokens(parent, seq.token_ids[i * bs:(i + 1) * bs],
                                            self.hash_salt))
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        """Gives the cached blocks matching `seq`'s longest prefix and the tokens they cover.

        At least the last token is always left to compute, so the step that
        admits the sequence still produces logits to sample from. After every full
        block hits, a cached partial tail block (`hash_prompt_tail`, what a KV
        transfer from a prefill engine brings) covers the rest but that last token.
        """
        if not self.enable_caching or seq.request.params.prompt_logprobs is not None:
            return [], 0
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        hashes = self._update_hashes(seq, max_blocks)
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                return hits, len(hits) * bs
            hits.append(block)
        tail = seq.token_ids[max_blocks * bs:]
        if len(tail) > 1:
            parent = hashes[max_blocks - 1] if max_blocks else lora_root_hash(
                seq.request.lora_name)
            block = self.pool.lookup(hash_block_tokens(parent, tail, self.hash_salt))
            if block is not None:
                return [*hits, block], seq.num_tokens - 1
        return hits, max_blocks * bs

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed: list[KVCacheBlock] | None = None,
        num_hit_tokens: int | None = None,
    ) -> list[tuple[int, int]] | None:
        """Makes room for `num_new_tokens` more tokens of `seq`; gives the block copies to do first.

        `computed` are prefix hits from `get_computed_blocks` and `num_hit_tokens` the
        tokens they cover (admission only); a partial tail hit is copied into a block of
        the sequence's own, so the cached tail stays as it is. Hit tokens past the
        `computed` blocks are a KV connector's (`kv_connector.base`): they get fresh
        blocks here, which the connector fills before the step.
        Gives None, changing nothing, when the pool is short. A shared partial
        block about to be written is copied first (copy-on-write): the returned
        (src, dst) pairs must be copied by the runner before the step's forward.
        """
        table = self.block_tables.get(seq.seq_id)
        if (not computed and num_new_tokens == 1 and table
                and len(table) * self.block_size > seq.num_computed_tokens
                and table[seq.num_computed_tokens // self.block_size].ref_cnt == 1):
            return []  # a decode token landing in an owned, unshared block: nothing to do
        computed = computed or []
        if table is None:
            table = self.block_tables[seq.seq_id] = []
        self._id_arrays.pop(seq.seq_id, None)
        full_hits = len(computed) * self.block_size
        if num_hit_tokens is None:
            num_hit_tokens = full_hits
        tail_hit = num_hit_tokens < full_hits  # the last hit is a partial tail block
        external = max(num_hit_tokens - full_hits, 0)  # a connector's, past the GPU hits
        num_hit_tokens -= external
        start = seq.num_computed_tokens + num_hit_tokens
        num_new_blocks = (cdiv(start + external + num_new_tokens, self.block_size) - len(table)
                          - len(computed))
        first = start // self.block_size
        cow = tail_hit or (first < len(table) and table[first].ref_cnt > 1)
        num_revived = sum(1 for b in computed if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + int(cow) + num_revived > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[seq.seq_id]
            return None
        copies: list[tuple[int, int]] = []
        if computed or external:
            self.pool.touch(computed)
            table.extend(computed)
            seq.num_computed_tokens = num_hit_tokens + external
            self._num_hashed_blocks[seq.seq_id] = len(computed) - int(tail_hit)
        if cow:
            (fresh,) = self.pool.allocate(1)
            copies.append((table[first].block_id, fresh.block_id))
            self.pool.free([table[first]])
            table[first] = fresh
        if num_new_blocks > 0:
            table.extend(self.pool.allocate(num_new_blocks))
        return copies

    def free_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Frees `seq`'s blocks past those its first `num_tokens` tokens need (the slots of
        rejected or never-proposed draft tokens; none of them is in the prefix cache)."""
        table = self.block_tables.get(seq.seq_id)
        keep = cdiv(num_tokens, self.block_size)
        if not table or len(table) <= keep:
            return
        tail = table[keep:]
        del table[keep:]
        self._id_arrays.pop(seq.seq_id, None)
        self.pool.free(tail[::-1])

    def record_prefix_lookup(self, seq: Sequence, num_hit_tokens: int) -> None:
        """Counts one admission's prefix-cache query and hit, in tokens."""
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers `seq`'s newly computed full blocks in the prefix cache (after a step)."""
        if not self.enable_caching:
            return
        table = self.block_tables.get(seq.seq_id)
        if not table:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        done = self._num_hashed_blocks.get(seq.seq_id, 0)
        if num_full <= done:
            return
        hashes = self._update_hashes(seq, num_full)
        for i in range(done, num_full):
            self.pool.cache(table[i], hashes[i])
        self._num_hashed_blocks[seq.seq_id] = num_full

    def _cache_prompt_tail(self, seq: Sequence) -> None:
        """Caches the block holding the prompt's partial last block, once its K/V is computed."""
        prompt = seq.request.prompt_token_ids
        table = self.block_tables.get(seq.seq_id)
        index = len(prompt) // self.block_size
        if not table or index >= len(table) or seq.num_computed_tokens < len(prompt):
            return
        tail_hash = hash_prompt_tail(prompt, self.block_size, self._update_hashes(seq, index),
                                     self.hash_salt)
        if tail_hash is not None:
            self.pool.cache(table[index], tail_hash)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Gives `child` the parent's blocks, shared by reference count."""
        table = self.block_tables.get(parent.seq_id)
        if not table:
            return  # a waiting parent owns no blocks yet
        self.pool.touch(table)
        self.block_tables[child.seq_id] = list(table)
        self._num_hashed_blocks[child.seq_id] = self._num_hashed_blocks.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        """Releases `seq`'s blocks, tail first so the prefix stays cached longest."""
        if self.cache_prompt_tails and self.enable_caching:
            self._cache_prompt_tail(seq)
        table = self.block_tables.pop(seq.seq_id, [])
        self._id_arrays.pop(seq.seq_id, None)
        self._num_hashed_blocks.pop(seq.seq_id, None)
        self.pool.free(table[::-1])
