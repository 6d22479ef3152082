"""EngineBlockStore over real per-layer KV tensors: bit-exact read -> import for every cache
dtype, the wire layout, multi-block chunks and import groups, and what runs under the lock
(enqueueing a constant number of ops, never a copy per block)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from disagg_fake_store import FakeStore
from disagg_import import import_data
from torch.utils._python_dispatch import TorchDispatchMode

from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.contracts.kv_client import request_pull
from kvpilot.engine.contracts.kv_protocol import ProtocolError
from kvpilot.engine.core.block_pool import BlockPool
from kvpilot.engine.kv_transfer import engine_store, host_buffers, tcp
from kvpilot.engine.kv_transfer.engine_store import EngineBlockStore
from kvpilot.engine.kv_transfer.tcp import TcpConnector

BLOCK, LAYERS, KV_HEADS, HEAD_DIM = 4, 3, 2, 8
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
BITS = {2: torch.int16, 4: torch.int32}


def make_store(num_blocks: int, dtype: torch.dtype = torch.float16, device: str = "cpu",
               seed: int = 0) -> EngineBlockStore:
    """Gives a store over a bare pool and per-layer caches full of random bit patterns."""
    generator = torch.Generator().manual_seed(seed)
    bits = BITS[torch.tensor([], dtype=dtype).element_size()]
    shape = (2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [torch.randint(-2**31, 2**31 - 1, shape, generator=generator, dtype=torch.int64)
              .to(bits).view(dtype).to(device) for _ in range(LAYERS)]
    return EngineBlockStore(BlockPool(num_blocks), caches, BLOCK)


def prompt(num_blocks: int, start: int = 1000) -> list[int]:
    return list(range(start, start + num_blocks * BLOCK + 1))  # plus one partial token


def compute(store: EngineBlockStore, tokens: list[int], seed: int = 1) -> list[int]:
    """Plays a prefill: caches the prompt's full blocks in shuffled slots; gives their hashes."""
    pool = store.pool
    everything = pool.allocate(pool.num_free_blocks)
    random.Random(seed).shuffle(everything)
    pool.free(everything)
    hashes = hash_prompt_blocks(tokens, BLOCK)
    blocks = pool.allocate(len(hashes))
    for block, block_hash in zip(blocks, hashes, strict=True):
        pool.cache(block, block_hash)
    pool.free(blocks[::-1])
    return hashes


def block_bits(store: EngineBlockStore, block_hash: int) -> torch.Tensor:
    block_id = store.pool.lookup(block_hash).block_id
    bits = BITS[store.caches[0].element_size()]
    return torch.stack([cache[:, block_id].view(bits).cpu() for cache in store.caches])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [1, 7, 32, 40])  # 40 > the reusable buffer's 32 blocks
def test_read_then_import_is_bit_exact(dtype, device, chunk):
    src, dst = make_store(48, dtype, device, seed=0), make_store(48, dtype, device, seed=9)
    tokens = prompt(40)
    compute(src, tokens)
    with src.lock:
        hashes, pinned = src.pin(tokens)
    assert len(hashes) == 40
    datas = []
    for start in range(0, 40, chunk):
        with src.lock:
            read = src.read(pinned, hashes[start:start + chunk])
        datas += [bytes(view) for view in read.wait()]
        read.release()
    for block_hash, data in zip(hashes, datas, strict=True):
        # the wire layout is layer-major [layers, 2, block_size, kv_heads, head_dim]
        block_id = src.pool.lookup(block_hash).block_id
        wire = torch.stack([cache[:, block_id] for cache in src.caches]).cpu()
        assert data == wire.contiguous().view(torch.uint8).numpy().tobytes()
    assert import_data(dst, hashes, datas) == 40
    for block_hash in hashes:
        assert torch.equal(block_bits(src, block_hash), block_bits(dst, block_hash))
    with src.lock:
        src.unpin(pinned)
    assert src.owned_blocks() == 0 and dst.owned_blocks() == 0


def test_import_skips_cached_blocks_and_keeps_their_data():
    src, dst = make_store(16), make_store(16, seed=5)
    tokens = prompt(6)
    hashes = compute(src, tokens)
    compute(dst, prompt(2, start=1000))  # the same first 2 blocks, other (stale) contents
    before = [block_bits(dst, h) for h in hashes[:2]]
    with src.lock:
        _, pinned = src.pin(tokens)
        read = src.read(pinned, hashes)
    assert import_data(dst, hashes, read.wait()) == 4
    assert [torch.equal(block_bits(dst, h), b) for h, b in zip(hashes, before, strict=False)] \
        == [True, True]
    for block_hash in hashes[2:]:
        assert torch.equal(block_bits(src, block_hash), block_bits(dst, block_hash))


def test_read_reuses_its_host_buffer():
    store = make_store(16)
    hashes = compute(store, prompt(8))
    with store.lock:
        _, pinned = store.pin(prompt(8))
    addresses = []
    for _ in range(3):
        with store.lock:
            read = store.read(pinned, hashes)
        addresses.append(np.frombuffer(read.wait()[0], np.uint8).ctypes.data)
        read.release()
    assert len(set(addresses)) == 1


class CountingLock:
    """An RLock that records, per outermost hold, the torch ops run in it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self.holds: list[int] = []  # aten ops per hold

    def __enter__(self) -> CountingLock:
        self._lock.acquire()
        self._depth += 1
        if self._depth == 1:
            self._ops = _OpCounter()
            self._ops.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._ops.__exit__(None, None, None)
            self.holds.append(self._ops.count)
        self._lock.release()


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


async def pull_between(src, dst, tokens: list[int]):
    """Offers `tokens` on an agent over store `src`, pulls it into store `dst`; gives DONE."""
    prefill = TcpConnector(src, "127.0.0.1", 0)
    decode = TcpConnector(dst, "127.0.0.1", 0)
    prefill.start()
    decode.start()
    try:
        with src.lock:
            prefill.offer("cmpl-1", tokens)
        return await request_pull(("127.0.0.1", decode.port), ("127.0.0.1", prefill.port),
                                  "cmpl-1", timeout=10)
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("dtype", DTYPES)
async def test_pull_between_engine_stores_chunks_and_groups(dtype):
    src, dst = make_store(48, dtype), make_store(48, dtype, seed=3)
    src.read_chunk_blocks = 4  # 9 chunks, two in flight at a time
    dst.receive_chunk_blocks = 3  # 12 groups through one pooled receive buffer
    tokens = prompt(40)
    hashes = compute(src, tokens)
    with src.lock, dst.lock:  # the decode side already holds the first 5 blocks
        _, pinned = src.pin(tokens[:5 * BLOCK])
        read = src.read(pinned, hashes[:5])
        src.unpin(pinned)
    assert import_data(dst, hashes[:5], read.wait()) == 5
    done = await pull_between(src, dst, tokens)
    assert done == {"imported": 35, "skipped": 5, "blocks": 40,
                    "transport": "tcp"}
    for block_hash in hashes:
        assert torch.equal(block_bits(src, block_hash), block_bits(dst, block_hash))
    assert src.owned_blocks() == 0 and dst.owned_blocks() == 0


async def test_lock_holds_do_not_grow_with_the_blocks_moved():
    """Under the engine lock only bookkeeping and a constant number of enqueued ops per hold
    run: the import does one index_copy_ per layer (not a copy per block and layer);
    receiving and staging happen outside. Reads take no engine lock at all, and each runs
    one gather per layer whatever its size. Pulls of 8 and 40 blocks (one read, two reads of
    up to 32) must run the same torch ops under each lock hold and in each read."""
    ops: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for num_blocks in (8, 40):
        src, dst = make_store(48), make_store(48, seed=2)
        src.lock, dst.lock = CountingLock(), CountingLock()
        src.read_chunk_blocks = 32
        reads: list[int] = []

        def counted_read(handle, hashes, read=src.read, reads=reads):
            with _OpCounter() as counter:
                pending = read(handle, hashes)
            reads.append(counter.count)
            return pending

        src.read = counted_read
        tokens = prompt(num_blocks)
        compute(src, tokens)
        done = await pull_between(src, dst, tokens)
        assert done["imported"] == num_blocks
        ops[num_blocks] = ([n for n in src.lock.holds if n],
                           [n for n in dst.lock.holds if n], reads)
    prefill_small, decode_small, reads_small = ops[8]
    prefill_large, decode_large, reads_large = ops[40]
    assert prefill_small == prefill_large == []  # the prefill engine's lock moves no data
    assert (len(reads_small), len(reads_large), len(decode_small)) == (1, 2, 1)
    assert decode_small == decode_large
    assert max(decode_large) <= 6 * LAYERS + 20
    assert set(reads_small) == set(reads_large)  # each read: the same ops, whatever the size
    assert max(reads_large) <= 4 * LAYERS + 20


def test_a_read_does_not_wait_for_the_engine_lock():
    """A prefill engine holds its lock through every step; reading a lease's blocks must not
    queue behind that (the lease lock keeps them pinned)."""
    store = make_store(16)
    tokens = prompt(4)
    compute(store, tokens)
    agent = TcpConnector(store, "127.0.0.1", 0, lease_seconds=30)
    with store.lock:
        agent.offer("cmpl-1", tokens)
    lease = agent.leases.get("cmpl-1", time.monotonic())
    stepping, done = threading.Event(), threading.Event()

    def engine_step() -> None:  # holds the engine lock until the read is done
        with store.lock:
            stepping.set()
            done.wait(30)

    engine = threading.Thread(target=engine_step)
    engine.start()
    reader = ThreadPoolExecutor(1)
    try:
        assert stepping.wait(5)
        # a read that waited for the lock would time out here
        datas = reader.submit(lambda: agent._read(lease, lease.hashes).wait()).result(5)
        assert [bytes(d) for d in datas] == [block_bits(store, h).numpy().tobytes()
                                             for h in lease.hashes]
    finally:
        done.set()
        engine.join(10)
        reader.shutdown()


@pytest.mark.parametrize("group_blocks", [2, 4, 1000])
async def test_short_pool_takes_the_leading_blocks_that_fit(group_blocks):
    src, dst = make_store(16), make_store(7, seed=4)
    running = dst.pool.allocate(1)  # a running request: 6 blocks free
    dst.receive_chunk_blocks = group_blocks
    tokens = prompt(10)
    hashes = compute(src, tokens)
    done = await pull_between(src, dst, tokens)  # the blocks that did not fit are drained
    assert done == {"imported": 6, "skipped": 0, "blocks": 10, "transport": "tcp"}
    assert dst.num_cached_prefix(hashes) == 6
    for block_hash in hashes[:6]:
        assert torch.equal(block_bits(src, block_hash), block_bits(dst, block_hash))
    assert src.owned_blocks() == 0  # released: the conversation ended normally
    dst.pool.free(running)


async def test_more_pulls_than_receive_buffers_wait_their_turn(monkeypatch):
    """Receive buffers are a bounded pool: pulls beyond it wait for one, none fails."""
    monkeypatch.setattr(engine_store, "RECEIVE_BUFFERS", 1)
    src, dst = make_store(64), make_store(64, seed=6)
    dst.receive_chunk_blocks = 2
    prefill = TcpConnector(src, "127.0.0.1", 0)
    decode = TcpConnector(dst, "127.0.0.1", 0)
    prefill.start()
    decode.start()
    try:
        for index in range(3):  # each prompt leased before the next prefill reuses free slots
            tokens = prompt(6, start=1000 + 500 * index)
            compute(src, tokens)
            with src.lock:
                prefill.offer(f"cmpl-{index}", tokens)
        done = await asyncio.gather(*(
            request_pull(("127.0.0.1", decode.port), ("127.0.0.1", prefill.port), f"cmpl-{i}",
                         timeout=10) for i in range(3)))
    finally:
        prefill.stop()
        decode.stop()
    assert [d["imported"] for d in done] == [6, 6, 6]
    assert dst.receive_buffers._made == 1


def test_buffer_pool_is_bounded_and_times_out():
    made = []
    pool = host_buffers.BufferPool(lambda p: made.append(object()) or made[-1], 2)
    first, second = pool.get(1), pool.get(1)
    assert first is not second and len(made) == 2
    with pytest.raises(TimeoutError, match="2 receive buffers"):
        pool.get(0.05)
    pool.put(first)
    assert pool.get(1) is first and len(made) == 2
    pool.fill()
    assert len(made) == 2  # already at its limit
    filled = host_buffers.BufferPool(lambda p: made.append(object()) or made[-1], 3)
    filled.fill()
    assert len(made) == 5 and {id(filled.get(1)) for _ in range(3)} == {id(b) for b in made[2:]}


def test_read_of_an_expired_lease_fails_instead_of_sending():
    store = FakeStore()
    tokens = list(range(1, 42))
    store.compute(tokens)
    agent = TcpConnector(store, "127.0.0.1", 0, lease_seconds=30)
    with store.lock:
        agent.offer("cmpl-1", tokens)
    lease = agent.leases.get("cmpl-1", time.monotonic())
    assert agent._read(lease, lease.hashes[:2]).wait()
    with store.lock:
        for expired in agent.leases.expire(float("inf")):
            store.unpin(expired.pinned)
    with pytest.raises(ProtocolError, match="expired mid-transfer"):
        agent._read(lease, lease.hashes[:2])


async def test_block_size_mismatch_is_a_clean_error():
    prefill_store, decode_store = FakeStore(block_bytes=64), FakeStore(block_bytes=32)
    tokens = list(range(1, 42))
    prefill_store.compute(tokens)
    with pytest.raises(ProtocolError, match="different model, dtype or block size"):
        await pull_between(prefill_store, decode_store, tokens)
    assert decode_store.blocks == {}


def test_spare_read_buffers_are_bounded():
    store = make_store(8)
    buffers = [store._host_buffer(1) for _ in range(engine_store.SPARE_READ_BUFFERS + 3)]
    for buffer in buffers:
        store._recycle(buffer)
    assert len(store._spare) == engine_store.SPARE_READ_BUFFERS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [64, 1000, 4096 * 3])
def test_device_checksums_equal_the_wire_checksum(device, size):
    """Engines sum many blocks at once where they are; peers check with protocol.checksum."""
    from kvpilot.engine.contracts.kv_protocol import checksum, pack_checksum
    from kvpilot.engine.kv_transfer.block_checksums import block_checksums

    data = torch.randint(0, 256, (7, size), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(size))
    got = [pack_checksum(a, b) for a, b in block_checksums(data.to(device)).cpu().tolist()]
    assert got == [checksum(row.numpy().tobytes()) for row in data]
    flipped = data.clone()
    flipped[3, size // 2] ^= 0x10
    swapped = data.clone()
    swapped[5, :2], swapped[5, 2:4] = data[5, 2:4], data[5, :2]  # two words trade places
    for changed, row in ((flipped, 3), (swapped, 5)):
        if torch.equal(changed[row], data[row]):
            continue
        again = block_checksums(changed.to(device)).cpu().tolist()[row]
        assert pack_checksum(*again) != got[row]


def test_corrupted_receive_is_rejected_before_import():
    src, dst = make_store(16), make_store(16, seed=5)
    tokens = prompt(6)
    hashes = compute(src, tokens)
    with src.lock:
        _, pinned = src.pin(tokens)
        read = src.read(pinned, hashes)
        datas, digests = [bytes(v) for v in read.wait()], read.checksums()
        src.unpin(pinned)
    buffer = dst.receive_buffer(5)
    for index, data in enumerate(datas):
        buffer.block(index)[:] = data
    buffer.block(4)[7] ^= 0x01
    staged = dst.stage(buffer, hashes)
    with pytest.raises(ProtocolError, match="checksum mismatch"):
        dst.verify(staged, digests)
    buffer.release()
    assert dst.num_cached_prefix(hashes) == 0


async def test_a_failed_pull_keeps_the_checked_groups_cached_and_owns_nothing(monkeypatch):
    """Groups import as they pass their checksums: a failure later in the transfer (here a
    block corrupted on the wire in the third group) leaves the groups before it as cached,
    unowned blocks, and nothing of the failed group or after it."""
    src, dst = make_store(16), make_store(16, seed=7)
    dst.receive_chunk_blocks = 2
    tokens = prompt(6)
    hashes = compute(src, tokens)
    real_encode_block = tcp.encode_block

    def corrupting_encode_block(block_hash, data, digest=None):
        header, head, data = real_encode_block(block_hash, data, digest)
        if block_hash == hashes[4]:
            data = bytes([data[0] ^ 0xFF]) + bytes(data)[1:]  # after the checksum was taken
        return [header, head, data]

    monkeypatch.setattr(tcp, "encode_block", corrupting_encode_block)
    with pytest.raises(ProtocolError, match="checksum mismatch"):
        await pull_between(src, dst, tokens)
    assert dst.num_cached_prefix(hashes) == 4
    assert dst.owned_blocks() == 0
