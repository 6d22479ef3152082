"""The host-memory KV tier as a connector: evicted GPU blocks go to a `HostKVPool`, prefix
hits there come back as loads instead of being recomputed.

The same pool is where a decode engine's KV agent lands the blocks it pulls from a
prefill engine (`landing_store`); without `--kv-offload-gb` it only does that, and
evicted blocks are not saved.

Copies run on the engine's stream (the thread's current one), so on CUDA they are
ordered with the steps without host waits: a save (device to pinned host memory,
per row) is enqueued before the forward that may overwrite its slot, and its rows
become findable only once its event has passed (`build_connector_meta` polls), so
no other writer can take a row whose copy is still in flight. A load (pinned host
memory to the device, per row) is checked on the device against the checksums the
rows were stored with; `wait_for_load` reads back one flag per block, which also
means the rows have been read when their pins drop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.block_hash import hash_prompt_tail
from kvpilot.engine.contracts.nixl_memory import LANDING_BYTES
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.kv_connector import (
    BlockLoad,
    KVConnector,
    KVConnectorMetadata,
    KVConnectorStats,
)
from kvpilot.engine.core.kv_events import KVEventLog
from kvpilot.engine.core.request import Sequence
from kvpilot.engine.executor.model_executor import ModelExecutor
from kvpilot.engine.kv_connector.host_pool import HostKVPool
from kvpilot.engine.kv_transfer.block_checksums import block_checksums
from kvpilot.engine.worker.device import to_device
from kvpilot.engine.worker.kv_shards import whole_block_bytes
from kvpilot.kernels.kv_cache_dtype import as_bytes

LOW_32_BITS = 0xFFFFFFFF
log = logging.getLogger(__name__)
GIB = 2**30


class HostTierConnector(KVConnector):
    """Saves evicted blocks to a host pool (when `offload`) and loads prefix hits from it."""

    def __init__(self, pool: HostKVPool, caches: list[torch.Tensor], block_size: int,
                 hash_salt: bytes, events: KVEventLog, offload: bool,
                 write: Callable[[list[int], torch.Tensor], None] | None = None) -> None:
        """`caches` are this process's per-layer KV tensors; `write` writes whole-head
        blocks into every rank's shard (a tensor-parallel decode engine's executor), by
        default into `caches` (one rank holding every head)."""
        self.pool, self.caches, self.block_size = pool, caches, block_size
        self.hash_salt, self.events, self.offload = hash_salt, events, offload
        self._write = write or self._scatter
        first = caches[0]
        self.device = first.device
        self._shape = (len(caches), 2, *first.shape[2:])  # one block, wire layout
        self._cuda = first.is_cuda
        self._saves: list[tuple[int, int]] = []
        self._loads: list[BlockLoad] = []
        self._matches: dict[int, tuple[list[int], list[int]]] = {}  # seq_id -> (rows, hashes)
        self._saving: list[tuple[torch.cuda.Event, list[tuple[int, int]]]] = []  # CUDA only
        self._loading: tuple[list[BlockLoad], torch.Tensor] | None = None
        self._stats = KVConnectorStats(host_blocks=pool.num_blocks)

    # ---- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        self._drop_match(seq.seq_id)
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        hashes = seq.block_hashes[:max_blocks]  # `get_computed_blocks` hashed them
        if num_computed_tokens % bs or len(hashes) < max_blocks:
            return 0  # a partial GPU hit covers the prompt, or prefix caching is off
        self._stats.external_queries += seq.num_tokens - num_computed_tokens
        wanted = hashes[num_computed_tokens // bs:]
        prompt = seq.request.prompt_token_ids
        if seq.num_tokens == len(prompt) and len(prompt) - max_blocks * bs > 1:
            # a prefill engine's partial last block: then only the last token is computed
            tail = hash_prompt_tail(prompt, bs, hashes, self.hash_salt)
            if tail is not None:
                wanted.append(tail)
        rows = self.pool.pin(wanted)
        if not rows:
            return 0
        self._matches[seq.seq_id] = (rows, wanted[:len(rows)])
        return min(len(rows) * bs, seq.num_tokens - 1 - num_computed_tokens)

    def update_state_after_alloc(self, seq: Sequence, num_computed_before: int,
                                 block_ids: list[int]) -> None:
        rows, hashes = self._matches.pop(seq.seq_id)
        self._loads.append(BlockLoad(seq, num_computed_before, block_ids[:len(rows)], hashes,
                                     rows))
        self._stats.external_hits += seq.num_computed_tokens - num_computed_before

    def on_evicted(self, block_id: int, block_hash: int) -> None:
        if self.offload:
            self._saves.append((block_id, block_hash))

    def build_connector_meta(self) -> KVConnectorMetadata:
        for seq_id in list(self._matches):
            self._drop_match(seq_id)
        self._commit_saved()
        for stored, block_hash in self.pool.take_events():
            if stored:
                self.events.stored(block_hash, host=True)
            else:
                self.events.removed(block_hash, host=True)
        meta = KVConnectorMetadata(self._saves, self._loads)
        self._saves, self._loads = [], []
        return meta

    def _drop_match(self, seq_id: int) -> None:
        match = self._matches.pop(seq_id, None)
        if match is not None:
            self.pool.unpin(match[0])

    def _commit_saved(self) -> None:
        """Makes saved rows findable once their device-to-host copies have run."""
        while self._saving and self._saving[0][0].query():
            self.pool.commit(self._saving.pop(0)[1])

    # ---- worker side ------------------------------------------------------------------

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        if not meta.saves:
            return
        slot_of = dict((h, b) for b, h in meta.saves)
        entries = self.pool.allocate([h for _, h in meta.saves])
        if not entries:
            return
        rows = [row for _, row in entries]
        data = self._gather([slot_of[h] for h, _ in entries])
        sums = block_checksums(data) & LOW_32_BITS
        if self._cuda:
            for index, row in enumerate(rows):
                self.pool.data[row].copy_(data[index], non_blocking=True)
                self.pool.sums[row].copy_(sums[index], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._saving.append((event, entries))
        else:
            index = torch.tensor(rows)
            self.pool.data[index] = data
            self.pool.sums[index] = sums
            self.pool.commit(entries)
        self._stats.saved_blocks += len(entries)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        if not meta.loads:
            return
        rows = [row for load in meta.loads for row in load.handle]
        slots = [slot for load in meta.loads for slot in load.block_ids]
        if self._cuda:
            data = torch.empty((len(rows), self.pool.block_bytes), dtype=torch.uint8,
                               device=self.device)
            for start, row, count in consecutive_runs(rows):  # one copy per run of rows
                data[start:start + count].copy_(self.pool.data[row:row + count],
                                                non_blocking=True)
            if self.pool.sums.is_cuda:  # a landing pool on the device
                stored = self.pool.sums[to_device(rows, self.device, torch.long)]
            else:  # 16 bytes a block: gathered into pinned memory, one copy, no host wait
                sums = torch.empty((len(rows), 2), dtype=torch.int64, pin_memory=True)
                torch.index_select(self.pool.sums, 0, torch.tensor(rows), out=sums)
                stored = sums.to(self.device, non_blocking=True)
        else:
            index = torch.tensor(rows)
            data, stored = self.pool.data[index], self.pool.sums[index]
        intact = ((block_checksums(data) & LOW_32_BITS) == stored).all(1)
        self._write(slots, data)
        self._loading = (meta.loads, intact)

    def wait_for_load(self) -> list[BlockLoad]:
        if self._loading is None:
            return []
        loads, intact = self._loading
        self._loading = None
        flags = intact.tolist()  # waits for the copies: the rows may be unpinned after
        failed: list[BlockLoad] = []
        position = 0
        for load in loads:
            ok = flags[position:position + len(load.handle)]
            position += len(load.handle)
            self.pool.unpin(load.handle)
            broken = [h for h, good in zip(load.hashes, ok, strict=True) if not good]
            if broken:
                self.pool.discard(broken)
                self._stats.load_failures += len(broken)
                failed.append(load)
            else:
                self._stats.loaded_blocks += len(load.handle)
        return failed

    def stats(self) -> KVConnectorStats:
        pool = self.pool.stats
        stats = self._stats
        stats.dropped_blocks, stats.evicted_blocks = pool.dropped, pool.evicted
        stats.host_usage = self.pool.usage
        return KVConnectorStats(**vars(stats))

    # ---- copies -----------------------------------------------------------------------

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """Gives uint8 [n, block_bytes] of the blocks, layer-major (the wire layout)."""
        index = to_device(block_ids, self.device, torch.long)
        blocks = torch.stack([as_bytes(cache).index_select(1, index).transpose(0, 1)
                              for cache in self.caches], dim=1)  # fp8 rows move as bytes
        return blocks.contiguous().view(torch.uint8).view(len(block_ids), -1)

    def _scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        byte_caches = [as_bytes(cache) for cache in self.caches]
        blocks = data.view(byte_caches[0].dtype).view(len(block_ids), *self._shape)
        index = to_device(block_ids, self.device, torch.long)
        for layer, cache in enumerate(byte_caches):
            cache.index_copy_(1, index, blocks[:, layer].transpose(0, 1))


def make_host_tier(args: EngineArgs, runner: ModelExecutor, kv: KVCacheManager
                   ) -> HostTierConnector | None:
    """Gives the host-tier connector `args` ask for (--kv-offload-gb, or a decode role's
    landing pool for pulled blocks), or None; raises ValueError naming the fix where the
    engine cannot have one."""
    if args.kv_offload_gb <= 0 and args.role != "decode":
        return None
    from kvpilot.engine.executor.multi_rank_executor import MultiRankExecutor
    from kvpilot.engine.worker.model_runner import ModelRunner

    what = (f"kv_offload_gb={args.kv_offload_gb}" if args.kv_offload_gb > 0
            else "role='decode'")
    if not args.enable_prefix_caching:
        raise ValueError(f"{what} needs prefix caching (blocks are found by their hash): drop "
                         "--no-enable-prefix-caching")
    write = None
    if isinstance(runner, MultiRankExecutor) and args.kv_offload_gb <= 0:
        # a tensor-parallel decode engine (make_executor refuses a host tier there): pulled
        # whole-head blocks go to every rank, each keeping its KV heads
        caches, write = runner.runner.kv_caches, runner.write_kv_blocks
        block_bytes = whole_block_bytes(caches, runner.runner.config.num_kv_heads)
    elif isinstance(runner, ModelRunner):
        caches = runner.kv_caches
        block_bytes = caches[0][:, 0].numel() * caches[0].element_size() * len(caches)
    else:
        raise ValueError(f"{what} needs a single-rank engine (the host tier copies one rank's "
                         "KV cache): use --tensor-parallel-size 1 --pipeline-parallel-size 1")
    cuda = runner.device.type == "cuda"
    if args.kv_offload_gb > 0:
        num_blocks, where = int(args.kv_offload_gb * GIB) // block_bytes, "cpu"
    elif cuda and args.kv_transport == "nixl":
        # NIXL READs land GPU to GPU (UCX cuda_ipc); into host memory they crawl: a bounded
        # pool on the device, whose rows a step copies into the cache like host rows
        num_blocks = min(runner.num_blocks, max(1, LANDING_BYTES // block_bytes))
        where = runner.device
    else:  # a decode engine without a host tier lands at most a GPU cache's worth
        num_blocks, where = runner.num_blocks, "cpu"
    pool = HostKVPool(num_blocks, block_bytes, pin_memory=cuda, device=where)
    log.info("%s: %d blocks of %d bytes (%.2f GiB) in %s memory",
             "host tier" if args.kv_offload_gb > 0 else "landing pool for pulled KV",
             num_blocks, block_bytes, num_blocks * block_bytes / GIB,
             "host" if where == "cpu" else f"{where} device")
    return HostTierConnector(pool, caches, args.block_size, kv.hash_salt, kv.pool.events,
                             offload=args.kv_offload_gb > 0, write=write)


def consecutive_runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """Gives (position in `rows`, first row, count) for each run of consecutive rows, so that
    blocks stored side by side in the host pool move in one copy."""
    runs: list[tuple[int, int, int]] = []
    for position, row in enumerate(rows):
        if runs and runs[-1][1] + runs[-1][2] == row:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((position, row, 1))
    return runs
