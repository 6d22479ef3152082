"""The KV-transfer handshake and pull protocol under random and mutated frames (hypothesis):
no crash, no hang, no block imported (or sent) without the fleet's secret, only verified
blocks imported from a stream mutated in flight, and the agents keep serving.

Two agents over dict stores (`disagg_fake_store`), sharing a fleet key: a prefill agent
holding a 10-block prompt under a lease, and a decode agent. Between them, for the
mutation test, a proxy that changes one byte of the prefill agent's answer (or cuts it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from disagg_fake_store import FakeStore, block_data
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.contracts.fleet_secret import FleetSecret
from kvpilot.engine.contracts.kv_auth import NONCE_BYTES, prove_to_agent_sync
from kvpilot.engine.contracts.kv_client import request_stats
from kvpilot.engine.contracts.kv_protocol import (
    HEADER,
    MAGIC,
    Frame,
    encode,
    encode_block,
    parse_header,
)
from kvpilot.engine.kv_transfer.tcp import TcpConnector

KEY = FleetSecret(bytes(range(32))).kv_key
PROMPT = list(range(1, 42))  # 10 full blocks of 4 tokens
LEASE = "cmpl-fuzz"
PULL_TIMEOUT = 1.0  # a PULL's own deadline, inside the bound below
HANG_S = 12.0  # any exchange ends within this (AUTH_TIMEOUT is 5 s)


class Forwarder:
    """A TCP proxy to `target` that applies `mutation` (offset, byte xor; xor 0: cut the
    stream there) to what the target answers, counting from each connection's first byte."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.mutation: tuple[int, int] | None = None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="fuzz-proxy").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            mutation = self.mutation
            threading.Thread(target=self._copy, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._copy, args=(upstream, client, mutation),
                             daemon=True).start()

    @staticmethod
    def _copy(src: socket.socket, dst: socket.socket, mutation: tuple[int, int] | None) -> None:
        sent = 0
        try:
            while chunk := src.recv(65536):
                if mutation is not None and sent <= mutation[0] < sent + len(chunk):
                    at, xor = mutation[0] - sent, mutation[1]
                    if xor == 0:  # cut the stream here
                        dst.sendall(chunk[:at])
                        break
                    chunk = chunk[:at] + bytes([chunk[at] ^ xor]) + chunk[at + 1:]
                dst.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            src.close()


class ForgedAgent:
    """A 'prefill agent' without the fleet's secret: answers anyone with `answer` bytes."""

    def __init__(self) -> None:
        self.answer = b""
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True, name="fuzz-forged").start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.settimeout(2.0)
                conn.recv(4096)  # whatever the decode agent opens with
                conn.sendall(self.answer)


class Fleet:
    """The two agents, the proxy in front of the prefill agent and a forged agent."""

    def __init__(self) -> None:
        self.prefill_store, self.decode_store = FakeStore(), FakeStore(capacity=1000)
        self.hashes = self.prefill_store.compute(PROMPT)
        self.prefill = TcpConnector(self.prefill_store, "127.0.0.1", 0, kv_key=KEY)
        self.decode = TcpConnector(self.decode_store, "127.0.0.1", 0, kv_key=KEY)
        self.prefill.start()
        self.decode.start()
        self.proxy = Forwarder(("127.0.0.1", self.prefill.port))
        self.forged = ForgedAgent()

    def reset(self) -> None:
        """Empties the decode store and offers the prompt's lease again."""
        with self.decode_store.lock:
            self.decode_store.blocks.clear()
            self.decode_store.pins.clear()
        with self.prefill_store.lock:
            assert self.prefill.offer(LEASE, PROMPT) == len(self.hashes)

    def check_imports(self) -> None:
        """Every block the decode side holds is one of the prompt's, with the data the
        prefill side cached: nothing forged, nothing damaged."""
        with self.decode_store.lock:
            held = dict(self.decode_store.blocks)
        for block_hash, data in held.items():
            assert block_hash in self.hashes, f"imported a block outside the lease: {block_hash}"
            assert data == block_data(block_hash, self.decode_store.block_bytes), \
                f"imported damaged or forged data for block {block_hash}"

    def check_serving(self) -> None:
        """Both agents still answer an authenticated STATS."""
        for agent in (self.prefill, self.decode):
            stats = asyncio.run(request_stats(("127.0.0.1", agent.port), timeout=HANG_S,
                                              key=KEY))
            assert set(stats) == {"leases", "leased_blocks", "owned_blocks"}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    started = Fleet()
    yield started
    started.proxy.listener.close()
    started.forged.listener.close()
    started.prefill.stop()
    started.decode.stop()


def exchange(port: int, data: bytes, authenticate: bool = False) -> bytes:
    """Gives what the agent on `port` answers to `data` (sent after the handshake when
    `authenticate`), reading until it closes; fails if that takes HANG_S."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as sock:
        if authenticate:
            prove_to_agent_sync(sock, KEY)
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        answer = bytearray()
        while chunk := sock.recv(65536):  # socket.timeout here is a hang
            answer += chunk
    assert time.monotonic() - started < HANG_S
    return bytes(answer)


def frame_kinds(answer: bytes) -> list[int]:
    """Gives the frame types of an agent's answer (as far as it parses)."""
    kinds, at = [], 0
    while at + HEADER.size <= len(answer):
        try:
            kind, length = parse_header(answer[at:at + HEADER.size])
        except Exception:  # an unparsable rest: stop there
            break
        kinds.append(int(kind))
        at += HEADER.size + length
    return kinds


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)
hex_fields = st.binary(min_size=0, max_size=40).map(bytes.hex) | st.text(max_size=70)
payloads = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={"nonce": hex_fields, "proof": hex_fields}).map(
        lambda v: json.dumps(v).encode()),
    st.builds(lambda remote, lease, timeout: json.dumps(
        {"remote": remote, "lease_id": lease, "timeout": timeout}).encode(),
        st.text(max_size=24), st.sampled_from([LEASE, "", "x"]) | st.text(max_size=8),
        st.floats(-1, PULL_TIMEOUT) | st.integers(-5, 1)),
    st.binary(max_size=64))
frame_kind_values = st.sampled_from([int(f) for f in Frame]) | st.integers(0, 255)


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    """Gives one frame: a valid or random header (magic, type, length) and a payload."""
    payload = draw(payloads)
    magic = draw(st.just(MAGIC) | st.binary(min_size=4, max_size=4))
    length = draw(st.just(len(payload)) | st.integers(0, 2**20) | st.integers(0, 2**64 - 1))
    return HEADER.pack(magic, draw(frame_kind_values), length) + payload


streams = st.lists(frames(), max_size=4).map(b"".join) | st.binary(max_size=512)


@settings(max_examples=120)
@given(data=streams)
def test_unauthenticated_frames_import_nothing_and_send_no_block(fleet: Fleet, data: bytes
                                                                 ) -> None:
    fleet.reset()
    for agent in (fleet.decode, fleet.prefill):
        answer = exchange(agent.port, data)
        # at most the agent's own AUTH challenge and its refusal: never a lease or a block
        assert set(frame_kinds(answer)) <= {int(Frame.AUTH), int(Frame.ERROR)}, answer[:200]
    assert fleet.decode_store.blocks == {}
    assert fleet.prefill.stats()["leases"] == 1  # nothing pulled, nothing released
    fleet.check_serving()


@st.composite
def forged_answers(draw: st.DrawFn) -> bytes:
    """Gives what a forged prefill agent sends: the protocol as it would go without the
    handshake (a LEASE of the real hashes, blocks of its choosing), or random frames."""
    if draw(st.booleans()):
        return draw(streams)
    store, hashes = FakeStore(), FakeStore().compute(PROMPT)
    parts = [encode(Frame.AUTH, {"nonce": draw(st.binary(min_size=NONCE_BYTES,
                                                         max_size=NONCE_BYTES)).hex(),
                                 "proof": draw(st.binary(min_size=32, max_size=32)).hex()})]
    parts.append(encode(Frame.LEASE, {"hashes": hashes, "block_bytes": store.block_bytes}))
    for block_hash in hashes:
        parts += [bytes(p) for p in encode_block(block_hash, b"\x07" * store.block_bytes)]
    return b"".join(parts) + encode(Frame.END)


@settings(max_examples=80)
@given(remote=st.sampled_from(["proxy", "forged", "closed", "garbage"]),
       lease=st.sampled_from([LEASE, "unknown"]) | st.text(max_size=8),
       timeout=st.floats(0.01, PULL_TIMEOUT), forged=forged_answers(),
       extra=st.lists(frames(), max_size=2).map(b"".join))
def test_authenticated_control_frames_never_import_unverified_blocks(
        fleet: Fleet, remote: str, lease: str, timeout: float, forged: bytes,
        extra: bytes) -> None:
    fleet.reset()
    fleet.proxy.mutation = None
    fleet.forged.answer = forged
    address = {"proxy": f"127.0.0.1:{fleet.proxy.port}", "forged": f"127.0.0.1:{fleet.forged.port}",
               "closed": "127.0.0.1:9", "garbage": "not an address"}[remote]
    answer = exchange(fleet.decode.port, encode(Frame.PULL, {
        "remote": address, "lease_id": lease, "timeout": timeout}) + extra, authenticate=True)
    # a PULL is always answered, a malformed one (its remote, its timeout) too
    assert frame_kinds(answer) in ([int(Frame.DONE)], [int(Frame.ERROR)]), answer[:300]
    if remote != "proxy" or lease != LEASE:
        assert fleet.decode_store.blocks == {}, (remote, lease)
    fleet.check_imports()
    fleet.check_serving()


@settings(max_examples=80)
@given(offset=st.integers(0, 1600), xor=st.integers(0, 255))
def test_a_pull_stream_mutated_in_flight_imports_only_verified_blocks(
        fleet: Fleet, offset: int, xor: int) -> None:
    fleet.reset()
    fleet.proxy.mutation = (offset, xor)
    answer = exchange(fleet.decode.port, encode(Frame.PULL, {
        "remote": f"127.0.0.1:{fleet.proxy.port}", "lease_id": LEASE,
        "timeout": PULL_TIMEOUT}), authenticate=True)
    assert frame_kinds(answer) in ([int(Frame.DONE)], [int(Frame.ERROR)]), answer[:300]
    fleet.check_imports()
    fleet.check_serving()


def test_the_fuzzed_pull_path_moves_blocks_when_nothing_is_mutated(fleet: Fleet) -> None:
    """The fixtures can pull at all: an unmutated pull through the proxy imports the prompt
    (so the properties above are not vacuous)."""
    fleet.reset()
    fleet.proxy.mutation = None
    answer = exchange(fleet.decode.port, encode(Frame.PULL, {
        "remote": f"127.0.0.1:{fleet.proxy.port}", "lease_id": LEASE, "timeout": 5.0}),
        authenticate=True)
    assert frame_kinds(answer) == [int(Frame.DONE)]
    assert set(fleet.decode_store.blocks) == set(fleet.hashes)
    fleet.check_imports()


