"""The KV-transfer wire format: length-prefixed binary frames over TCP; torch-free.

Every frame is a 13-byte header — magic `KVP1`, a one-byte type, an 8-byte
payload length, all little-endian — then the payload. Control frames carry
JSON; a BLOCK frame carries one KV block: its 8-byte hash, an 8-byte blake2b
checksum of the data, then the data (every layer's K and V for the block).
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
import hashlib
import json
import struct
from enum import IntEnum
from typing import Any

from kvpilot.engine.args import KV_PORT_OFFSET

MAGIC = b"KVP1"
HEADER = struct.Struct("<4sBQ")
BLOCK_HEAD = struct.Struct("<Q8s")
MAX_CONTROL_BYTES = 16 * 2**20
MAX_BLOCK_BYTES = 2**31


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
    """Gives the 8-byte blake2b digest a BLOCK frame carries for its data."""
    return hashlib.blake2b(data, digest_size=8).digest()


def encode(kind: Frame, message: dict[str, Any] | None = None) -> bytes:
    """Gives a control frame: header plus JSON payload."""
    payload = json.dumps(message or {}).encode()
    return HEADER.pack(MAGIC, kind, len(payload)) + payload


def encode_block(block_hash: int, data: bytes | memoryview) -> list[bytes | memoryview]:
    """Gives a BLOCK frame as buffers to write in order (the data is not copied)."""
    head = BLOCK_HEAD.pack(block_hash, checksum(data))
    return [HEADER.pack(MAGIC, Frame.BLOCK, len(head) + len(data)), head, data]


async def read_frame(reader: asyncio.StreamReader) -> tuple[Frame, bytes]:
    """Gives the next frame's type and payload; raises ProtocolError on garbage."""
    try:
        magic, kind, length = HEADER.unpack(await reader.readexactly(HEADER.size))
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"connection closed mid-frame ({len(exc.partial)} bytes)") from exc
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: the peer does not speak KVP1")
    try:
        frame = Frame(kind)
    except ValueError as exc:
        raise ProtocolError(f"unknown frame type {kind}") from exc
    limit = MAX_BLOCK_BYTES if frame is Frame.BLOCK else MAX_CONTROL_BYTES
    if length > limit:
        raise ProtocolError(f"{frame.name} frame of {length} bytes exceeds {limit}")
    try:
        return frame, await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"connection closed inside a {frame.name} frame") from exc


async def expect(reader: asyncio.StreamReader, *kinds: Frame) -> tuple[Frame, dict[str, Any]]:
    """Gives the next control frame if it is one of `kinds`; an ERROR frame raises."""
    frame, payload = await read_frame(reader)
    message = json.loads(payload) if frame is not Frame.BLOCK else {}
    if frame is Frame.ERROR and Frame.ERROR not in kinds:
        raise ProtocolError(f"peer error: {message.get('message')}")
    if frame not in kinds:
        raise ProtocolError(f"expected {'/'.join(k.name for k in kinds)}, got {frame.name}")
    return frame, message


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
