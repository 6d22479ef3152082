"""The BlockStore over a running LLMEngine: its block pool and per-layer KV tensors.

A block's data on the wire is every layer's K and V for that block, layer-major:
[num_layers, 2, block_size, num_kv_heads, head_dim] in the cache dtype, copied
through host memory so CPU and GPU engines interoperate.

The engine lock is held only to look blocks up and to *enqueue* copies:

- read (prefill side, without the engine lock: pinned blocks do not move): one
  gather per layer plus one device-to-host copy into a reusable host buffer
  (pinned on CUDA) are enqueued on a side stream, not ordered after the engine's
  stream: a lease's blocks were written by steps the host has already seen
  finish (the request's first token came back), and the steps in flight only
  write other blocks, or the slots past the prompt in its tail block; the agent
  waits for the copy's event and sends memoryviews of that buffer.
- import (decode side): the agent receives blocks a buffer-full at a time into a
  pooled host buffer (pinned on CUDA, see `receive_buffer`) and `stage` copies them to
  the device on a side stream, both without the lock; under the lock only the pool
  bookkeeping runs and one
  `index_copy_` per layer is enqueued, on the engine's stream (after waiting for
  the side stream), so the write lands after any step already in flight there.

On CPU every copy is synchronous: the same code runs, the "enqueued" copies run
at once (the gather and the per-layer `index_copy_` under the lock).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvpilot.engine.contracts.block_hash import UNSALTED, hash_prompt_blocks, hash_prompt_tail
from kvpilot.engine.contracts.kv_protocol import ProtocolError, pack_checksum
from kvpilot.engine.core.block_pool import BlockPool, KVCacheBlock
from kvpilot.engine.kv_transfer.block_checksums import block_checksums
from kvpilot.engine.kv_transfer.fair_lock import FairLock
from kvpilot.engine.kv_transfer.host_buffers import BufferPool, ReceiveBuffer
from kvpilot.engine.worker.device import to_device
from kvpilot.kernels.kv_cache_dtype import as_bytes

# one reusable host buffer of `read` holds up to this many bytes (and at most 256 blocks): each
# read takes the lock once, and on a busy prefill engine the lock comes once per step
READ_BUFFER_BYTES = 128 * 2**20
READ_BUFFER_MAX_BLOCKS = 256
SPARE_READ_BUFFERS = 4  # host buffers kept for reuse; more in flight at once are dropped after
# incoming blocks land in pooled host buffers of this many bytes (at most 256 blocks), one per
# pull in flight; a pull beyond the pool's size waits for one (within its deadline)
RECEIVE_BUFFER_BYTES = 64 * 2**20
RECEIVE_BUFFERS = 8

if TYPE_CHECKING:
    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.core.kv_cache_manager import KVCacheManager


class CacheOwner(Protocol):
    """What the store reads of an engine (`LLMEngine`; kv_transfer sits below the engine loop):
    its KV cache manager, the executor holding the caches, its flags."""

    @property
    def kv(self) -> KVCacheManager: ...

    @property
    def runner(self) -> object: ...

    @property
    def engine_args(self) -> EngineArgs: ...


class PendingRead:
    """Blocks being copied into a host buffer; `wait` gives their data, `release` recycles it."""

    def __init__(self, store: EngineBlockStore, buffer: torch.Tensor, count: int,
                 event: torch.cuda.Event | None, sums: torch.Tensor) -> None:
        self._store, self._count, self._event = store, count, event
        self._buffer: torch.Tensor | None = buffer  # None once released
        self._sums = sums  # [count, 2] int64 on the host (pinned on CUDA), see block_checksums

    def wait(self) -> list[memoryview]:
        """Blocks until the copy has finished (call without the lock); gives each block's data.

        The views alias the host buffer: use them before `release`.
        """
        if self._buffer is None:
            raise RuntimeError("PendingRead.wait after release: its host buffer is reused")
        if self._event is not None:
            self._event.synchronize()
        size = self._store.block_bytes
        data = self._buffer.view(-1).numpy().data
        return [data[i * size:(i + 1) * size] for i in range(self._count)]

    def checksums(self) -> list[bytes]:
        """Gives each block's checksum field (after `wait`), computed where the blocks were."""
        return [pack_checksum(a, b) for a, b in self._sums.tolist()]

    def release(self) -> None:
        """Gives the host buffer back for reuse; the views `wait` gave must not be used after."""
        if self._buffer is not None:
            self._store._recycle(self._buffer)
            self._buffer = None


class StagedBlocks:
    """Blocks on their way to the cache's device (uint8 [n, block_bytes]) and their hashes."""

    def __init__(self, hashes: list[int], data: torch.Tensor,
                 copied: torch.cuda.Event | None) -> None:
        self.hashes, self.data, self.copied = hashes, data, copied  # copied: None on CPU
        # event after the cache writes, recorded by import_blocks (CUDA only)
        self.written: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Blocks until `import_blocks`' writes into the cache have run (call without the lock)."""
        if self.written is not None:
            self.written.synchronize()


@dataclass
class CudaStreams:
    """Where a store on a GPU enqueues its copies."""

    engine: torch.cuda.Stream  # the engine's steps, and the cache writes of imports after them
    side: torch.cuda.Stream  # reads, staging and checksums, beside the steps
    last_read: torch.cuda.Event | None = None  # of the last read enqueued on `side`


class EngineBlockStore:
    """Pins, reads and imports blocks of one engine by content hash.

    It sees the engine through its block pool (the bookkeeping) and its per-layer KV
    caches, each [2, num_blocks, block_size, num_kv_heads, head_dim].
    """

    def __init__(self, pool: BlockPool, caches: list[torch.Tensor], block_size: int,
                 hash_salt: bytes = UNSALTED) -> None:
        self.pool = pool
        self.caches = caches
        self.block_size = block_size
        self.hash_salt = hash_salt  # the prefix cache's (`KVCacheManager.hash_salt`)
        first = caches[0]
        self.block_bytes: int = first[:, 0].numel() * first.element_size() * len(caches)
        self.lock = FairLock()  # the engine thread retakes it every step: FIFO, not RLock
        self.read_chunk_blocks = max(1, min(READ_BUFFER_MAX_BLOCKS,
                                            READ_BUFFER_BYTES // self.block_bytes))
        self.receive_chunk_blocks = max(1, min(READ_BUFFER_MAX_BLOCKS,
                                               RECEIVE_BUFFER_BYTES // self.block_bytes))
        self.receive_buffers = BufferPool(self._new_receive_buffer, RECEIVE_BUFFERS)
        self.device = first.device
        self._shape = (len(caches), 2, *first.shape[2:])
        self._dtype = first.dtype
        # The engine enqueues its steps on this thread's current stream (the default one);
        # imported cache writes go there too, so they are ordered after any step in flight.
        # An engine that steps on another stream must set `cuda.engine` to it. None on CPU,
        # where every copy is synchronous.
        self.cuda = CudaStreams(torch.cuda.current_stream(self.device),
                                torch.cuda.Stream(self.device)) if first.is_cuda else None
        self._spare: list[torch.Tensor] = []
        self._spare_lock = threading.Lock()

    @classmethod
    def of_engine(cls, engine: CacheOwner) -> EngineBlockStore:
        """Gives the store over `engine`'s block pool and KV caches (one rank's: a
        tensor-parallel engine's caches are sharded, and config.validate refuses roles)."""
        from kvpilot.engine.worker.model_runner import ModelRunner

        runner = engine.runner
        if not isinstance(runner, ModelRunner):
            raise ValueError("KV transfer needs a single-rank engine: use "
                             "--tensor-parallel-size 1 with --role prefill|decode")
        # an fp8 cache moves as its bytes (CPU torch cannot index fp8); a peer with another
        # KV dtype has other block bytes and is refused at the handshake
        return cls(engine.kv.pool, [as_bytes(c) for c in runner.kv_caches],
                   engine.engine_args.block_size, engine.kv.hash_salt)

    # ---- with the lock held -------------------------------------------------------------

    def pin(self, token_ids: Sequence[int]) -> tuple[list[int], list[KVCacheBlock]]:
        """Gives (hashes, blocks) of the prompt's cached leading full blocks, now pinned, and
        of its partial last block when every full block is there and the engine cached it
        (a prefill engine does, `KVCacheManager.cache_prompt_tails`): the decode engine then
        computes only the prompt's last token."""
        tokens = list(token_ids)
        hashes = hash_prompt_blocks(tokens, self.block_size, salt=self.hash_salt)
        blocks = self._cached_prefix(hashes)
        tail = hash_prompt_tail(tokens, self.block_size, hashes, self.hash_salt)
        if len(blocks) == len(hashes) and tail is not None:
            block = self.pool.lookup(tail)
            if block is not None:
                hashes, blocks = [*hashes, tail], [*blocks, block]
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
        """Drops the pins, tail first so the prompt's head stays cached longest.

        On CUDA the engine's stream first waits for the reads enqueued so far (no host
        wait), so a step that reuses a freed block cannot overwrite it before a read of
        it still in flight (a lease expiring mid-transfer) has run.
        """
        if self.cuda is not None and self.cuda.last_read is not None:
            self.cuda.engine.wait_event(self.cuda.last_read)
        self.pool.free(handle[::-1])

    def owned_blocks(self) -> int:
        """Gives how many blocks have a reference (running requests or leases)."""
        return self.pool.num_blocks - self.pool.num_free_blocks

    def num_cached_prefix(self, hashes: Sequence[int]) -> int:
        """Gives how many leading hashes the prefix cache holds."""
        return len(self._cached_prefix(hashes))

    def import_blocks(self, staged: StagedBlocks, prefix_hashes: Sequence[int] = ()) -> int:
        """Writes staged blocks into free slots as cached, unowned blocks; gives how many.

        They join the free queue's tail like a finished request's blocks, so the
        request that follows finds them as prefix hits. Blocks already cached are
        skipped; when the pool is short, only the leading blocks that fit go in.
        The locally cached `prefix_hashes` are pinned meanwhile, so allocating
        room for the new blocks cannot evict the prefix they extend. The data is
        written by one `index_copy_` per layer, enqueued on the engine's stream.
        """
        held = [b for b in (self.pool.lookup(h) for h in prefix_hashes) if b is not None]
        self.pool.touch(held)
        try:
            rows = [i for i, h in enumerate(staged.hashes) if self.pool.lookup(h) is None]
            rows = rows[:self.pool.num_free_blocks]
            if rows:
                self._write(staged, rows)
        finally:
            self.pool.free(held[::-1])
        return len(rows)

    def _write(self, staged: StagedBlocks, rows: list[int]) -> None:
        slots = self.pool.allocate(len(rows))
        try:
            if self.cuda is not None:
                stream = self.cuda.engine
                with torch.cuda.device(self.device), torch.cuda.stream(stream):
                    if staged.copied is not None:
                        stream.wait_event(staged.copied)
                    staged.data.record_stream(stream)
                    self._scatter(staged, rows, [s.block_id for s in slots])
                    staged.written = torch.cuda.Event()
                    staged.written.record(stream)
            else:
                self._scatter(staged, rows, [s.block_id for s in slots])
            for slot, row in zip(slots, rows, strict=True):
                self.pool.cache(slot, staged.hashes[row])
        finally:
            self.pool.free(slots[::-1])

    def _scatter(self, staged: StagedBlocks, rows: list[int], block_ids: list[int]) -> None:
        data = staged.data.view(self._dtype).view(len(staged.hashes), *self._shape)
        if len(rows) != len(staged.hashes):
            data = data.index_select(0, to_device(rows, self.device, torch.long))
        index = to_device(block_ids, self.device, torch.long)
        for layer, cache in enumerate(self.caches):
            cache.index_copy_(1, index, data[:, layer].transpose(0, 1))

    # ---- without the engine lock ---------------------------------------------------------

    def read(self, handle: list[KVCacheBlock], hashes: Sequence[int]) -> PendingRead:
        """Enqueues the copy of the pinned blocks with these hashes into a host buffer.

        One gather per layer into a device tensor laid out [n, layers, 2, block_size,
        kv_heads, head_dim] (the wire layout, block after block), then one copy to the
        host buffer, on the side stream. It does not wait for the engine's stream (a
        prefill step of thousands of tokens): the blocks of a finished prompt were
        written by steps that have completed, since the host has read the token they
        sampled. The caller keeps `handle` pinned (a live lease) while it enqueues.
        """
        by_hash = {b.block_hash: b for b in handle}
        ids = [by_hash[h].block_id for h in hashes]
        buffer = self._host_buffer(len(ids))
        out = buffer[:len(ids)].view(self._dtype).view(len(ids), *self._shape)
        if self.cuda is None:
            self._gather(torch.tensor(ids), out)
            return PendingRead(self, buffer, len(ids), None, block_checksums(buffer[:len(ids)]))
        side = self.cuda.side
        with torch.cuda.device(self.device), torch.cuda.stream(side):
            index = to_device(ids, self.device, torch.long)
            staging = torch.empty(out.shape, dtype=self._dtype, device=self.device)
            self._gather(index, staging)
            out.copy_(staging, non_blocking=True)
            sums = torch.empty((len(ids), 2), dtype=torch.int64, pin_memory=True)
            sums.copy_(block_checksums(staging.view(torch.uint8).view(len(ids), -1)),
                       non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        self.cuda.last_read = event
        return PendingRead(self, buffer, len(ids), event, sums)

    def slots(self, handle: list[KVCacheBlock], hashes: Sequence[int],
              out: torch.Tensor | None = None) -> tuple[list[int], list[bytes]]:
        """Gives the pinned blocks' ids and their checksum fields, for a NIXL reader.

        The sums come from a gather on the device (the side stream on CUDA, a chunk at a
        time), like `read`'s, without the copy to the host; the gather lands in `out`
        (uint8 [len(hashes), block_bytes], a NIXL send region's rows, complete when this
        returns) when given, so the peer reads those rows, else in scratch memory, and the
        peer reads the cache.
        """
        by_hash = {b.block_hash: b for b in handle}
        ids = [by_hash[h].block_id for h in hashes]
        sums: list[list[int]] = []
        # packing into `out` needs no bounded scratch: one chunk, one wait
        size = self.read_chunk_blocks if out is None else max(1, len(ids))
        for first in range(0, len(ids), size):
            chunk = ids[first:first + size]
            staging = (torch.empty((len(chunk), *self._shape), dtype=self._dtype,
                                   device=self.device) if out is None else
                       out[first:first + len(chunk)].view(self._dtype)
                       .view(len(chunk), *self._shape))
            if self.cuda is None:
                self._gather(torch.tensor(chunk), staging)
                sums += block_checksums(staging.view(torch.uint8).view(len(chunk), -1)).tolist()
                continue
            with torch.cuda.device(self.device), torch.cuda.stream(self.cuda.side):
                self._gather(to_device(chunk, self.device, torch.long), staging)
                # .tolist() waits for the side stream: the rows are written when it returns
                sums += block_checksums(staging.view(torch.uint8).view(len(chunk), -1)).tolist()
        return ids, [pack_checksum(a, b) for a, b in sums]

    def _gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        torch.stack([cache.index_select(1, index).transpose(0, 1) for cache in self.caches],
                    dim=1, out=out)

    def receive_buffer(self, timeout: float) -> ReceiveBuffer:
        """Gives a pooled host buffer of `receive_chunk_blocks` blocks, waiting up to `timeout`
        seconds while all are in use; `release` it after the last `verify` or import of it.

        Fixed-size, reused, pinned on CUDA. Measured on 2x H200: with a fresh pinned
        buffer per pull (a whole prompt, a GiB for 8k tokens of an 8B model) the decode
        engine had stalls of 0.3-8 s while pulls ran, which went away with pageable
        buffers (pinning fresh memory is the suspect); pageable buffers in turn halved
        the transfer rate and tripled the engine's slow iterations (the staging copies
        then run through the driver in the pulling thread).
        """
        return self.receive_buffers.get(timeout)

    def _new_receive_buffer(self, pool: BufferPool[ReceiveBuffer]) -> ReceiveBuffer:
        return ReceiveBuffer(torch.empty((self.receive_chunk_blocks, self.block_bytes),
                                         dtype=torch.uint8, pin_memory=self.cuda is not None),
                             pool)

    def stage(self, buffer: ReceiveBuffer, hashes: Sequence[int]) -> StagedBlocks:
        """Starts copying the first len(hashes) blocks of `buffer` to the cache's device.

        On CUDA the copy is enqueued on the side stream (`verify` waits for it, so the
        buffer is free again after it); `import_blocks` orders the cache writes after it.
        On CPU the buffer's rows are used as they are, until `import_blocks` copies them.
        """
        rows = buffer.tensor[:len(hashes)]
        if self.cuda is None:
            return StagedBlocks(list(hashes), rows, None)
        side = self.cuda.side
        with torch.cuda.device(self.device), torch.cuda.stream(side):
            data = rows.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        return StagedBlocks(list(hashes), data, copied)

    def verify(self, staged: StagedBlocks, digests: Sequence[bytes]) -> None:
        """Raises ProtocolError unless every staged block's checksum is its frame's (no lock).

        The sums run where the blocks were staged (the side stream on CUDA), and only
        the [n, 2] sums come back to the host.
        """
        data = staged.data
        if self.cuda is not None:
            side = self.cuda.side
            with torch.cuda.device(self.device), torch.cuda.stream(side):
                if staged.copied is not None:
                    side.wait_event(staged.copied)
                sums = block_checksums(data).cpu()
        else:
            sums = block_checksums(data)
        for index, ((plain, weighted), digest) in enumerate(zip(sums.tolist(), digests,
                                                                strict=True)):
            if pack_checksum(plain, weighted) != digest:
                raise ProtocolError(f"checksum mismatch on block {staged.hashes[index]:#x}: "
                                    "data corrupted")

    # ---- host buffers of `read` ---------------------------------------------------------

    def _host_buffer(self, num_blocks: int) -> torch.Tensor:
        """Gives a uint8 [>= num_blocks, block_bytes] host buffer, reused when one is spare."""
        if num_blocks <= self.read_chunk_blocks:
            with self._spare_lock:
                if self._spare:
                    return self._spare.pop()
            num_blocks = self.read_chunk_blocks
        return torch.empty((num_blocks, self.block_bytes), dtype=torch.uint8,
                           pin_memory=self.cuda is not None)

    def _recycle(self, buffer: torch.Tensor) -> None:
        if buffer.shape[0] != self.read_chunk_blocks:
            return
        with self._spare_lock:
            if len(self._spare) < SPARE_READ_BUFFERS:
                self._spare.append(buffer)
