"""The KV-transfer wire format: length-prefixed binary frames over TCP; torch-free.

Every frame is a 13-byte header — magic `KVP2`, a one-byte type, an 8-byte
payload length, all little-endian — then the payload. Control frames carry
JSON; a BLOCK frame carries one KV block: its 8-byte hash, an 8-byte checksum
of the data (see `checksum`), then the data (every layer's K and V for the block).
One block per frame keeps memory flat and lets a long prompt stream.

Conversation (the decode side pulls; see the router section of docs/architecture.md for why),
each connection opened by the challenge-response of `kv_auth` (AUTH frames):

    router -> decode agent : PULL {"remote": "host:port", "lease_id", "timeout"}
    decode -> prefill agent: FETCH {"lease_id"}
    prefill -> decode      : LEASE {"hashes": [...], "block_bytes"}
    decode -> prefill      : WANT {"hashes": [the ones it lacks]}
    prefill -> decode      : BLOCK x len(WANT), then END {}
    decode -> prefill      : RELEASE {"lease_id"}   (prefill unpins the blocks)
    decode -> router       : DONE {"imported", "skipped"}  or  ERROR {"message"}

and, for operators and tests, STATS {} -> STATS {"leases", "leased_blocks", "owned_blocks"}.

With `--kv-transport nixl` on both sides (`kv_transfer/nixl_agent.py`) FETCH carries
`"nixl": true`, LEASE a `"nixl"` part (agent name, metadata, cache layout), and the
blocks move by NIXL READs instead of BLOCK frames:

    decode -> prefill      : WANT {"hashes", "nixl": true}
    prefill -> decode      : SLOTS {"block_ids", "checksums"}   (then the decode side READs)
    decode -> prefill      : RELEASE {"lease_id"}
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import numpy as np

from kvpilot.engine.contracts.args import KV_PORT_OFFSET

MAGIC = b"KVP2"  # KVP1 had no handshake
HEADER = struct.Struct("<4sBQ")
BLOCK_HEAD = struct.Struct("<Q8s")
MAX_CONTROL_BYTES = 16 * 2**20
MAX_BLOCK_BYTES = 2**31
SENDMSG_MAX_BUFFERS = 512  # under the kernel's IOV_MAX (1024 on Linux)
SCATTER_BLOCKS = SENDMSG_MAX_BUFFERS // 2  # BLOCK frames per scatter read (two parts each)
FRAME_HEAD = HEADER.size + BLOCK_HEAD.size  # a BLOCK frame's bytes before its data
CHECKSUM_MODULUS = 32749  # prime < 2**15: a 16-bit word times its weight fits in int32


class Frame(IntEnum):
    PULL = 1
    FETCH = 2
    LEASE = 3
    WANT = 4
    BLOCK = 5
    END = 6
    RELEASE = 7
    DONE = 8
    ERROR = 9
    STATS = 10
    AUTH = 11
    SLOTS = 12  # the NIXL path's answer to WANT: where the blocks are, and their checksums


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame, or the wrong one."""


def checksum(data: bytes | memoryview) -> bytes:
    """Gives the 8-byte checksum field a BLOCK frame carries for its data.

    Two Fletcher-style sums over the data's little-endian 16-bit words: their plain
    sum and their sum weighted by position (weights 1..CHECKSUM_MODULUS, repeating),
    each mod 2**32. It catches flipped bits and moved words; the block hash in the
    frame catches moved blocks. Engines compute the same sums for many blocks at
    once on the device (`kv_transfer.block_checksums`), so neither side spends
    host time per byte; this numpy version serves tests and byte-level callers.
    """
    raw = bytes(data) + b"\0" if len(data) % 2 else data
    words = np.frombuffer(raw, dtype="<u2").astype(np.int64)
    weights = np.arange(words.size, dtype=np.int64) % CHECKSUM_MODULUS + 1
    return pack_checksum(int(words.sum()), int((words * weights).sum()))


def pack_checksum(plain: int, weighted: int) -> bytes:
    """Gives the checksum field of the two sums."""
    return ((plain & 0xFFFFFFFF) | (weighted & 0xFFFFFFFF) << 32).to_bytes(8, "little")


def encode(kind: Frame, message: dict[str, Any] | None = None) -> bytes:
    """Gives a control frame: header plus JSON payload."""
    payload = json.dumps(message or {}).encode()
    return HEADER.pack(MAGIC, kind, len(payload)) + payload


def encode_block(block_hash: int, data: bytes | memoryview,
                 digest: bytes | None = None) -> list[bytes | memoryview]:
    """Gives a BLOCK frame as buffers to write in order (the data is not copied); `digest`
    is the data's `checksum` when the caller computed it already."""
    head = BLOCK_HEAD.pack(block_hash, checksum(data) if digest is None else digest)
    return [HEADER.pack(MAGIC, Frame.BLOCK, len(head) + len(data)), head, data]


def parse_header(raw: bytes | bytearray) -> tuple[Frame, int]:
    """Gives (frame type, payload length) of a 13-byte header; raises ProtocolError on garbage."""
    magic, kind, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: the peer does not speak {MAGIC.decode()}")
    try:
        frame = Frame(kind)
    except ValueError as exc:
        raise ProtocolError(f"unknown frame type {kind}") from exc
    limit = MAX_BLOCK_BYTES if frame is Frame.BLOCK else MAX_CONTROL_BYTES
    if length > limit:
        raise ProtocolError(f"{frame.name} frame of {length} bytes exceeds {limit}")
    return frame, length


def parse_control(frame: Frame, payload: bytes, kinds: tuple[Frame, ...]) -> dict[str, Any]:
    """Gives a control frame's message if the frame is one of `kinds`; an ERROR frame raises,
    and so does (ProtocolError) a payload that is not a JSON object."""
    message = json_object(frame, payload) if frame is not Frame.BLOCK else {}
    if frame is Frame.ERROR and Frame.ERROR not in kinds:
        raise ProtocolError(f"peer error: {message.get('message')}")
    if frame not in kinds:
        raise ProtocolError(f"expected {'/'.join(k.name for k in kinds)}, got {frame.name}")
    return message


def json_object(frame: Frame, payload: bytes) -> dict[str, Any]:
    """Gives a control frame's JSON object; raises ProtocolError for anything else."""
    try:
        message = json.loads(payload) if payload else {}
    except ValueError as exc:  # invalid JSON or UTF-8
        raise ProtocolError(f"{frame.name} frame payload is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError(f"{frame.name} frame payload is not a JSON object")
    return message


def hash_list(message: dict[str, Any], key: str) -> list[int]:
    """Gives message[key] as block hashes (ints in [0, 2**64)); ProtocolError otherwise."""
    value = message.get(key)
    if not isinstance(value, list) or not all(
            type(h) is int and 0 <= h < 2**64 for h in value):
        raise ProtocolError(f"{key!r} is not a list of 64-bit block hashes")
    return value


async def read_frame(reader: asyncio.StreamReader) -> tuple[Frame, bytes]:
    """Gives the next frame's type and payload; raises ProtocolError on garbage."""
    try:
        frame, length = parse_header(await reader.readexactly(HEADER.size))
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"connection closed mid-frame ({len(exc.partial)} bytes)") from exc
    try:
        return frame, await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"connection closed inside a {frame.name} frame") from exc


async def expect(reader: asyncio.StreamReader, *kinds: Frame) -> tuple[Frame, dict[str, Any]]:
    """Gives the next control frame if it is one of `kinds`; an ERROR frame raises."""
    frame, payload = await read_frame(reader)
    return frame, parse_control(frame, payload, kinds)


# ---- the same on a blocking socket (the bulk path runs in worker threads) ------------------
#
# Each call below waits in one system call with the GIL released (MSG_WAITALL, sendmsg
# of many buffers), so a busy engine thread in the same process slows a transfer by a
# few GIL handoffs per block, where an event loop needed one per 256 KiB read.


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` from `sock`; raises ProtocolError if the peer closes first."""
    got, size = 0, len(view)
    while got < size:
        count = sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
        if count == 0:
            raise ProtocolError(f"connection closed mid-frame ({got} of {size} bytes)")
        got += count


def read_frame_sync(sock: socket.socket) -> tuple[Frame, bytes]:
    """Gives the next frame's type and payload from a blocking socket."""
    header = bytearray(HEADER.size)
    recv_exactly(sock, memoryview(header))
    frame, length = parse_header(header)
    payload = bytearray(length)
    recv_exactly(sock, memoryview(payload))
    return frame, bytes(payload)


def expect_sync(sock: socket.socket, *kinds: Frame) -> tuple[Frame, dict[str, Any]]:
    """Gives the next control frame from a blocking socket if it is one of `kinds`."""
    frame, payload = read_frame_sync(sock)
    return frame, parse_control(frame, payload, kinds)


def read_blocks_into(sock: socket.socket, views: list[memoryview],
                     deadline: Callable[[], float]) -> list[tuple[int, bytes]]:
    """Reads len(views) BLOCK frames, each block's data straight into its view; gives each
    frame's (block hash, checksum field) for the caller to check.

    Up to SCATTER_BLOCKS frames land by one scatter read (MSG_WAITALL), so the
    thread takes the GIL back once per batch, not per block. A peer that stops
    early (an error on its side) closes the connection: ProtocolError here.
    `deadline()` gives the seconds left, set as the socket's kernel timeouts.
    """
    heads = bytearray(FRAME_HEAD * len(views))
    head_view = memoryview(heads)
    for first in range(0, len(views), SCATTER_BLOCKS):
        parts: list[memoryview] = []
        for index in range(first, min(first + SCATTER_BLOCKS, len(views))):
            parts += [head_view[index * FRAME_HEAD:(index + 1) * FRAME_HEAD], views[index]]
        set_kernel_timeouts(sock, deadline())
        got, _, _, _ = sock.recvmsg_into(parts, 0, socket.MSG_WAITALL)
        for part in parts:  # interrupted or short: finish part by part
            if got >= len(part):
                got -= len(part)
                continue
            recv_exactly(sock, part[got:])
            got = 0
    out = []
    for index, view in enumerate(views):
        head = heads[index * FRAME_HEAD:(index + 1) * FRAME_HEAD]
        frame, length = parse_header(head[:HEADER.size])
        if frame is not Frame.BLOCK or length != BLOCK_HEAD.size + len(view):
            raise ProtocolError(f"frame {index} is {frame.name} of {length} bytes, expected a "
                                f"BLOCK of {len(view)}")
        out.append(BLOCK_HEAD.unpack(head[HEADER.size:]))
    return out


def set_kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Bounds each blocking send/receive on `sock` to `seconds` (SO_SNDTIMEO/SO_RCVTIMEO).

    A Python-level `settimeout` would make the socket non-blocking, and MSG_WAITALL
    would then return after every partial read.
    """
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6) or (0 if whole else 1000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def send_buffers(sock: socket.socket, buffers: list[bytes | memoryview]) -> None:
    """Sends `buffers` in order by scatter-gather writes (no copies)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first:first + SENDMSG_MAX_BUFFERS])
        while sent:
            size = len(views[first])
            if sent >= size:
                sent -= size
                first += 1
            else:
                views[first] = views[first][sent:]
                sent = 0


def decode_block(payload: bytes) -> tuple[int, memoryview]:
    """Gives (block hash, data) of a BLOCK payload; raises ProtocolError on a bad checksum."""
    block_hash, digest = BLOCK_HEAD.unpack_from(payload)
    data = memoryview(payload)[BLOCK_HEAD.size:]
    if checksum(data) != digest:
        raise ProtocolError(f"checksum mismatch on block {block_hash:#x}: data corrupted")
    return block_hash, data


def kv_address(engine_url: str, kv_port: int = 0,
               offset: int = KV_PORT_OFFSET) -> tuple[str, int]:
    """Gives the (host, port) of an engine's KV agent: `kv_port`, else its HTTP port + offset
    (the engine's `--kv-transfer-port 0` default)."""
    rest = engine_url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), kv_port or int(port) + offset
