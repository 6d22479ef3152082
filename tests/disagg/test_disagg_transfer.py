"""The TCP KV connector between two block stores: pulls, skips, checksums, leases, failures."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest
from disagg_fake_store import FakeStore, block_data

from kvpilot.engine.contracts import kv_protocol as protocol
from kvpilot.engine.contracts.kv_auth import prove_to_agent
from kvpilot.engine.contracts.kv_client import NO_SECRET_KEY, request_pull, request_stats
from kvpilot.engine.contracts.kv_protocol import Frame, ProtocolError
from kvpilot.engine.kv_transfer import tcp
from kvpilot.engine.kv_transfer.tcp import TcpConnector

PROMPT = list(range(1, 42))  # 10 full blocks of 4 tokens, one partial


@pytest.fixture
def agents():
    started: list[TcpConnector] = []

    def start(store: FakeStore, lease_seconds: float = 30.0) -> TcpConnector:
        agent = TcpConnector(store, "127.0.0.1", 0, lease_seconds=lease_seconds)
        agent.start()
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.stop()


def addr(agent: TcpConnector) -> tuple[str, int]:
    return ("127.0.0.1", agent.port)


@pytest.mark.parametrize(("decode_has", "capacity", "imported", "skipped"), [
    (0, 1000, 10, 0),  # nothing cached: every block moves
    (4, 1000, 6, 4),  # the decode side already holds the first 4 blocks: they stay home
    (10, 1000, 0, 10),  # it holds all: nothing moves
    (0, 3, 3, 0),  # a full decode pool takes the leading blocks that fit
])
async def test_pull_moves_the_missing_blocks(agents, decode_has, capacity, imported, skipped):
    prefill_store, decode_store = FakeStore(), FakeStore(capacity=1000)
    hashes = prefill_store.compute(PROMPT)
    for h in hashes[:decode_has]:
        decode_store.blocks[h] = block_data(h, 64)
    decode_store.capacity = decode_has + capacity if capacity < 1000 else 1000
    prefill, decode = agents(prefill_store), agents(decode_store)
    with prefill_store.lock:
        assert prefill.offer("cmpl-1", PROMPT) == 10
    assert prefill_store.pinned == 10
    done = await request_pull(addr(decode), addr(prefill), "cmpl-1", timeout=5)
    assert done == {"imported": imported, "skipped": skipped, "blocks": 10, "transport": "tcp"}
    for h in hashes[:skipped + imported]:
        assert decode_store.blocks[h] == block_data(h, 64)
    await asyncio.sleep(0.05)  # the RELEASE lands just after DONE
    assert prefill_store.pinned == 0 and len(prefill.leases) == 0


async def test_the_pull_socket_sends_small_frames_at_once(agents, monkeypatch):
    """TCP_NODELAY on the decode side's socket: with Nagle's algorithm its FETCH, sent right
    after the proof frame, waited for the peer's delayed ACK (~40 ms a pull on Linux)."""
    nodelay: list[int] = []
    set_timeouts = tcp.set_kernel_timeouts

    def recording(sock: socket.socket, seconds: float) -> None:
        nodelay.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        set_timeouts(sock, seconds)

    monkeypatch.setattr(tcp, "set_kernel_timeouts", recording)
    prefill_store = FakeStore()
    prefill_store.compute(PROMPT)
    prefill, decode = agents(prefill_store), agents(FakeStore(capacity=1000))
    with prefill_store.lock:
        prefill.offer("cmpl-nodelay", PROMPT)
    done = await request_pull(addr(decode), addr(prefill), "cmpl-nodelay", timeout=5)
    assert done["imported"] == 10
    assert nodelay and all(nodelay)


async def test_unknown_lease_is_an_error_not_a_hang(agents):
    prefill, decode = agents(FakeStore()), agents(FakeStore())
    start = time.monotonic()
    with pytest.raises(ProtocolError, match="unknown or expired"):
        await request_pull(addr(decode), addr(prefill), "cmpl-missing", timeout=5)
    assert time.monotonic() - start < 2


async def test_unpulled_lease_expires_and_unpins(agents):
    store = FakeStore()
    store.compute(PROMPT)
    prefill = agents(store, lease_seconds=0.3)
    with store.lock:
        prefill.offer("cmpl-1", PROMPT)
    assert store.pinned == 10
    assert await request_stats(addr(prefill)) == {"leases": 1, "leased_blocks": 10,
                                                  "owned_blocks": 10}
    deadline = time.monotonic() + 30
    while store.pinned and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert store.pinned == 0 and len(prefill.leases) == 0
    assert await request_stats(addr(prefill)) == {"leases": 0, "leased_blocks": 0,
                                                  "owned_blocks": 0}


async def test_decode_vanishing_mid_transfer_leaves_the_lease_to_expire(agents):
    store = FakeStore()
    store.compute(PROMPT)
    prefill = agents(store, lease_seconds=0.5)
    with store.lock:
        prefill.offer("cmpl-1", PROMPT)
    reader, writer = await asyncio.open_connection(*addr(prefill))
    await prove_to_agent(reader, writer, NO_SECRET_KEY)
    writer.write(protocol.encode(Frame.FETCH, {"lease_id": "cmpl-1"}))
    _, lease = await protocol.expect(reader, Frame.LEASE)
    writer.write(protocol.encode(Frame.WANT, {"hashes": lease["hashes"]}))
    await writer.drain()
    await protocol.read_frame(reader)  # one block, then the decode side dies
    writer.transport.abort()
    assert store.pinned == 10  # still leased: the peer might have been slow, not dead
    await asyncio.sleep(1.2)
    assert store.pinned == 0


async def test_block_corrupted_on_the_wire_is_rejected_and_nothing_imported(agents,
                                                                            monkeypatch):
    def corrupting_encode_block(block_hash, data, digest=None):
        header, head, data = protocol.encode_block(block_hash, data, digest)
        flipped = bytes([data[0] ^ 0xFF]) + bytes(data)[1:]  # after the checksum was taken
        return [header, head, flipped]

    monkeypatch.setattr(tcp, "encode_block", corrupting_encode_block)
    prefill_store, decode_store = FakeStore(), FakeStore()
    prefill_store.compute(PROMPT)
    prefill, decode = agents(prefill_store), agents(decode_store)
    with prefill_store.lock:
        prefill.offer("cmpl-1", PROMPT)
    with pytest.raises(ProtocolError, match="checksum mismatch"):
        await request_pull(addr(decode), addr(prefill), "cmpl-1", timeout=5)
    assert decode_store.blocks == {}


async def test_checksum_detects_a_flipped_bit():
    buffers = protocol.encode_block(7, b"abcdefgh" * 8)
    frame = b"".join(bytes(b) for b in buffers)
    payload = bytearray(frame[protocol.HEADER.size:])
    assert protocol.decode_block(bytes(payload))[0] == 7
    payload[-1] ^= 1
    with pytest.raises(ProtocolError, match="checksum mismatch"):
        protocol.decode_block(bytes(payload))


@pytest.mark.parametrize(("raw", "error"), [
    (b"XXXX" + bytes(9), "bad magic"),
    (protocol.HEADER.pack(protocol.MAGIC, 99, 0), "unknown frame type 99"),
    (protocol.HEADER.pack(protocol.MAGIC, Frame.PULL, 2**40), "exceeds"),
    (protocol.HEADER.pack(protocol.MAGIC, Frame.PULL, 10) + b"{}", "inside a PULL frame"),
    (b"KVP", "closed mid-frame"),
])
async def test_bad_frames(raw, error):
    reader = asyncio.StreamReader()
    reader.feed_data(raw)
    reader.feed_eof()
    with pytest.raises(ProtocolError, match=error):
        await protocol.read_frame(reader)


@pytest.mark.parametrize(("url", "port", "expected"), [
    ("http://127.0.0.1:8001", 0, ("127.0.0.1", 9001)),
    ("http://10.0.0.5:8000/", 7000, ("10.0.0.5", 7000)),
    ("http://[fd00::1]:8000", 0, ("fd00::1", 9000)),
])
def test_kv_address(url, port, expected):
    assert protocol.kv_address(url, port) == expected


async def test_prefill_agent_gone_fails_fast(agents):
    decode = agents(FakeStore())
    with contextlib.closing(__import__("socket").socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        dead = ("127.0.0.1", sock.getsockname()[1])
    start = time.monotonic()
    with pytest.raises(ProtocolError, match="failed"):
        await request_pull(addr(decode), dead, "cmpl-1", timeout=5)
    assert time.monotonic() - start < 2


def test_stop_closes_the_conversations_still_open():
    """A peer mid-conversation when the agent stops sees its connection closed at once,
    rather than held open by a handler dropped with the agent's event loop."""
    agent = TcpConnector(FakeStore(), "127.0.0.1", 0)
    agent.start()
    peer = socket.create_connection(addr(agent), timeout=5)
    try:
        time.sleep(0.2)  # the agent's handler is now waiting for the handshake
        started = time.monotonic()
        agent.stop()
        assert peer.recv(1) == b""  # EOF, not the 5 s timeout
        assert time.monotonic() - started < 3
    finally:
        peer.close()
