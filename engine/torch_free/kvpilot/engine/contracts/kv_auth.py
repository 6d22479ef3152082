"""The challenge-response that opens every KV-agent connection; torch-free.

    client -> agent : AUTH {"nonce": Nc}
    agent -> client : AUTH {"nonce": Na, "proof": HMAC(key, "agent" Nc Na)}
    client -> agent : AUTH {"proof": HMAC(key, "client" Nc Na)}

then the conversation of `kv_protocol`. `key` is the fleet secret's `kv_key`; each side
draws a fresh 16-byte nonce per connection, so a recorded exchange proves nothing on
another connection (replay), and the labels keep one side's proof from serving as the
other's (reflection). Each side checks the other's proof in constant time; an agent
answers a peer that fails with ERROR and closes before it reads any request: a forged
PULL never makes it pull. The agent reads a header before its payload and takes only a
small AUTH frame, so an unauthenticated peer cannot make it buffer a large frame.

Threat model: anyone who can open a TCP connection to the port. Frames after the
handshake are not signed: an attacker on the path between two agents (who can also read
the KV data) needs transport encryption (a mesh with mTLS), not this.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import socket

from kvpilot.engine.contracts.kv_protocol import (
    HEADER,
    Frame,
    ProtocolError,
    encode,
    parse_header,
    recv_exactly,
)

NONCE_BYTES = 16
MAX_AUTH_BYTES = 512  # an AUTH frame's payload: two hex strings and their keys
AUTH_TIMEOUT = 5.0  # seconds a peer gets to complete the handshake
REFUSED = ("authentication failed: the peer does not hold this fleet's secret "
           "(--fleet-secret-file differs, or it speaks no KVP2)")


def _proof(key: bytes, side: str, client_nonce: bytes, agent_nonce: bytes) -> str:
    return hmac.new(key, side.encode() + client_nonce + agent_nonce, hashlib.sha256).hexdigest()


def _field(message: dict[str, object], name: str, size: int) -> bytes:
    """Gives the hex field `name` as bytes of length `size`; ProtocolError otherwise."""
    value = message.get(name)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise ProtocolError(f"AUTH frame without a valid {name!r}: {REFUSED}")
    return raw


def _check_header(frame: Frame, length: int) -> None:
    """Raises unless a header read where AUTH is due announces a small AUTH frame (or the
    peer's ERROR: it refused us, and says why)."""
    if frame is not Frame.ERROR and (frame is not Frame.AUTH or length > MAX_AUTH_BYTES):
        raise ProtocolError(f"expected an AUTH frame, got {frame.name} of {length} bytes: "
                            f"{REFUSED}")


def _message(frame: Frame, payload: bytes) -> dict[str, object]:
    try:
        message = json.loads(payload) if payload else {}
    except ValueError as exc:  # invalid JSON or UTF-8
        raise ProtocolError(f"AUTH payload is not JSON: {REFUSED}") from exc
    if not isinstance(message, dict):
        raise ProtocolError(f"AUTH payload is not a JSON object: {REFUSED}")
    if frame is Frame.ERROR:
        raise ProtocolError(f"peer error: {message.get('message')}")
    return message


async def _read_auth(reader: asyncio.StreamReader) -> dict[str, object]:
    try:
        frame, length = parse_header(await reader.readexactly(HEADER.size))
        _check_header(frame, length)
        return _message(frame, await reader.readexactly(length))
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError("connection closed during the handshake") from exc


def _read_auth_sync(sock: socket.socket) -> dict[str, object]:
    header = bytearray(HEADER.size)
    recv_exactly(sock, memoryview(header))
    frame, length = parse_header(header)
    _check_header(frame, length)
    payload = bytearray(length)
    recv_exactly(sock, memoryview(payload))
    return _message(frame, bytes(payload))


async def accept_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      key: bytes) -> None:
    """Runs the agent's side of the handshake; raises ProtocolError (after telling the peer)
    unless the peer proved it holds `key`. Bound it by AUTH_TIMEOUT."""
    try:
        client_nonce = _field(await _read_auth(reader), "nonce", NONCE_BYTES)
        agent_nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(encode(Frame.AUTH, {"nonce": agent_nonce.hex(), "proof": _proof(
            key, "agent", client_nonce, agent_nonce)}))
        await writer.drain()
        given = _field(await _read_auth(reader), "proof", 32).hex()
        if not hmac.compare_digest(given, _proof(key, "client", client_nonce, agent_nonce)):
            raise ProtocolError(REFUSED)
    except (ProtocolError, ValueError) as exc:
        writer.write(encode(Frame.ERROR, {"message": REFUSED}))
        raise ProtocolError(f"refused a KV connection: {exc}") from exc


async def prove_to_agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         key: bytes) -> None:
    """Runs the client's side of the handshake on an asyncio connection; raises
    ProtocolError when the agent refuses us or fails to prove it holds `key`."""
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    writer.write(encode(Frame.AUTH, {"nonce": client_nonce.hex()}))
    await writer.drain()
    writer.write(encode(Frame.AUTH, {"proof": _answer(await _read_auth(reader), key,
                                                      client_nonce)}))
    await writer.drain()


def prove_to_agent_sync(sock: socket.socket, key: bytes) -> None:
    """Runs the client's side of the handshake on a blocking socket (its timeouts bound it)."""
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(encode(Frame.AUTH, {"nonce": client_nonce.hex()}))
    sock.sendall(encode(Frame.AUTH, {"proof": _answer(_read_auth_sync(sock), key,
                                                      client_nonce)}))


def _answer(challenge: dict[str, object], key: bytes, client_nonce: bytes) -> str:
    """Gives the client's proof once the agent's proof in `challenge` checks out."""
    agent_nonce = _field(challenge, "nonce", NONCE_BYTES)
    given = _field(challenge, "proof", 32).hex()
    if not hmac.compare_digest(given, _proof(key, "agent", client_nonce, agent_nonce)):
        raise ProtocolError("the KV agent failed authentication: it does not hold this "
                            "fleet's secret (--fleet-secret-file differs)")
    return _proof(key, "client", client_nonce, agent_nonce)
