"""The KV-transfer wire format: length-prefixed binary frames over TCP; torch-free.

Every frame is a 13-byte header — magic `KVP1`, a one-byte type, an 8-byte
payload length, all little-endian — then the payload. Control frames carry
JSON; a BLOCK frame carries one KV block: its 8-byte hash, the data's CRC-32
(in an 8-byte field), then the data (every layer's K and V for the block).
One block per frame keeps memory flat and lets a long prompt stream.

Conversation (the decode side pulls; see the router section of docs/architecture.md for why):

    router -> decode agent : PULL {"remote": "host:port", "lease_id", "timeout"}
    decode -> prefill agent: FETCH {"lease_id"}
    prefill -> decode      : LEASE {"hashes": [...], "block_bytes"}
    decode -> prefill      : WANT {"hashes": [the ones it lacks]}
    prefill -> decode      : BLOCK x len(WANT), then END {}
    decode -> prefill      : RELEASE {"lease_id"}   (prefill unpins the blocks)
    decode -> router       : DONE {"imported", "skipped"}  or  ERROR {"message"}

and, for operators and tests, STATS {} -> STATS {"leases", "leased_blocks", "owned_blocks"}.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import zlib
from enum import IntEnum
from typing import Any

from kvpilot.engine.args import KV_PORT_OFFSET

MAGIC = b"KVP1"
HEADER = struct.Struct("<4sBQ")
BLOCK_HEAD = struct.Struct("<Q8s")
MAX_CONTROL_BYTES = 16 * 2**20
MAX_BLOCK_BYTES = 2**31
SENDMSG_MAX_BUFFERS = 512  # under the kernel's IOV_MAX (1024 on Linux)


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


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame, or the wrong one."""


def checksum(data: bytes | memoryview) -> bytes:
    """Gives the 8-byte checksum field a BLOCK frame carries for its data: its CRC-32.

    CRC-32 catches corruption in transit (what a checksum is for here; the peers
    trust each other) at ~4 GB/s on one core, where an 8-byte blake2b ran at
    ~0.7 GB/s and capped a pull of long prompts' blocks below the offered load.
    """
    return zlib.crc32(data).to_bytes(8, "little")


def encode(kind: Frame, message: dict[str, Any] | None = None) -> bytes:
    """Gives a control frame: header plus JSON payload."""
    payload = json.dumps(message or {}).encode()
    return HEADER.pack(MAGIC, kind, len(payload)) + payload


def encode_block(block_hash: int, data: bytes | memoryview) -> list[bytes | memoryview]:
    """Gives a BLOCK frame as buffers to write in order (the data is not copied)."""
    head = BLOCK_HEAD.pack(block_hash, checksum(data))
    return [HEADER.pack(MAGIC, Frame.BLOCK, len(head) + len(data)), head, data]


def parse_header(raw: bytes | bytearray) -> tuple[Frame, int]:
    """Gives (frame type, payload length) of a 13-byte header; raises ProtocolError on garbage."""
    magic, kind, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: the peer does not speak KVP1")
    try:
        frame = Frame(kind)
    except ValueError as exc:
        raise ProtocolError(f"unknown frame type {kind}") from exc
    limit = MAX_BLOCK_BYTES if frame is Frame.BLOCK else MAX_CONTROL_BYTES
    if length > limit:
        raise ProtocolError(f"{frame.name} frame of {length} bytes exceeds {limit}")
    return frame, length


def parse_control(frame: Frame, payload: bytes, kinds: tuple[Frame, ...]) -> dict[str, Any]:
    """Gives a control frame's message if the frame is one of `kinds`; an ERROR frame raises."""
    message = json.loads(payload) if frame is not Frame.BLOCK else {}
    if frame is Frame.ERROR and Frame.ERROR not in kinds:
        raise ProtocolError(f"peer error: {message.get('message')}")
    if frame not in kinds:
        raise ProtocolError(f"expected {'/'.join(k.name for k in kinds)}, got {frame.name}")
    return message


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


def read_block_into(sock: socket.socket, view: memoryview) -> int:
    """Reads the next frame, which must be a BLOCK of len(view) bytes, into `view`;
    gives its block hash after checking the checksum. An ERROR or early END raises."""
    header = bytearray(HEADER.size)
    recv_exactly(sock, memoryview(header))
    frame, length = parse_header(header)
    if frame is not Frame.BLOCK:
        payload = bytearray(length)
        recv_exactly(sock, memoryview(payload))
        parse_control(frame, bytes(payload), (Frame.BLOCK,))  # raises: ERROR text or the type
    if length != BLOCK_HEAD.size + len(view):
        raise ProtocolError(f"BLOCK of {length - BLOCK_HEAD.size} bytes, expected {len(view)}")
    head = bytearray(BLOCK_HEAD.size)
    count, _, _, _ = sock.recvmsg_into([head, view], 0, socket.MSG_WAITALL)
    if count < length:  # interrupted: finish both parts
        done_head = min(count, BLOCK_HEAD.size)
        recv_exactly(sock, memoryview(head)[done_head:])
        recv_exactly(sock, view[max(count - BLOCK_HEAD.size, 0):])
    block_hash, digest = BLOCK_HEAD.unpack(head)
    if checksum(view) != digest:
        raise ProtocolError(f"checksum mismatch on block {block_hash:#x}: data corrupted")
    return block_hash


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


async def request_pull(decode_agent: tuple[str, int], remote: tuple[str, int], lease_id: str,
                       timeout: float) -> dict[str, Any]:
    """Asks a decode agent to pull a lease from a prefill agent; gives its DONE message."""
    return await _ask(decode_agent, Frame.PULL, {"remote": f"{remote[0]}:{remote[1]}",
                                                 "lease_id": lease_id, "timeout": timeout},
                      Frame.DONE, timeout)


async def request_stats(agent: tuple[str, int], timeout: float = 5.0) -> dict[str, Any]:
    """Gives an agent's lease and block counts (STATS)."""
    return await _ask(agent, Frame.STATS, {}, Frame.STATS, timeout)


async def _ask(agent: tuple[str, int], kind: Frame, message: dict[str, Any], reply: Frame,
               timeout: float) -> dict[str, Any]:
    """Gives the agent's `reply` to one control frame, each step bounded by `timeout`."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*agent), timeout)
    try:
        writer.write(encode(kind, message))
        await writer.drain()
        _, answer = await asyncio.wait_for(expect(reader, reply), timeout)
        return answer
    finally:
        writer.close()
