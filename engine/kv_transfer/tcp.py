"""The default KV connector: an asyncio TCP agent beside the engine, on its own thread.

One agent per engine serves both conversations of protocol.py: as a prefill
agent it answers FETCH (lease's hashes), WANT (stream the blocks) and RELEASE;
as a decode agent it answers the router's PULL by fetching from the prefill
agent, checking every block's checksum, and importing the blocks into the
engine's prefix cache. Blocks are buffered until END and imported in one locked
step, so a peer that vanishes mid-transfer leaves nothing allocated here; on
the prefill side the lease expires and unpins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvpilot.engine.kv_transfer.connector import BlockStore, KVConnector
from kvpilot.engine.kv_transfer.leases import LeaseTable
from kvpilot.engine.kv_transfer.protocol import (
    Frame,
    ProtocolError,
    decode_block,
    encode,
    encode_block,
    expect,
    read_frame,
)

log = logging.getLogger("kvpilot.kv_transfer")
EXPIRY_TICK = 0.5
READ_CHUNK_BLOCKS = 32


class TcpConnector(KVConnector):
    """Serves FETCH/WANT/RELEASE (prefill) and PULL (decode) on host:port."""

    def __init__(self, store: BlockStore, host: str, port: int, lease_seconds: float = 30.0,
                 pull_attempts: int = 2) -> None:
        self.store = store
        self.host, self.port = host, port
        self.leases: LeaseTable[Any] = LeaseTable(lease_seconds)
        self.pull_attempts = pull_attempts
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvpilot-kv-agent",
                                        daemon=True)
        self._server: asyncio.Server | None = None
        self._expiry: asyncio.Task[None] | None = None

    # ---- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._expiry = asyncio.create_task(self._expire_forever())
        log.info("KV agent listening on %s:%d", self.host, self.port)

    def stop(self) -> None:
        async def _stop() -> None:
            if self._expiry:
                self._expiry.cancel()
            if self._server:
                self._server.close()
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        with self.store.lock:
            for lease in self.leases.expire(float("inf")):
                self.store.unpin(lease.pinned)

    # ---- prefill side -----------------------------------------------------------------

    def offer(self, lease_id: str, token_ids: Sequence[int]) -> int:
        hashes, pinned = self.store.pin(token_ids)
        replaced = self.leases.open(lease_id, hashes, pinned, time.monotonic())
        if replaced is not None:
            self.store.unpin(replaced.pinned)
        return len(hashes)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_TICK)
            with self.store.lock:
                for lease in self.leases.expire(time.monotonic()):
                    log.warning("lease %s expired unpulled: unpinning %d blocks",
                                lease.lease_id, len(lease.hashes))
                    self.store.unpin(lease.pinned)

    async def _serve_fetch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           message: dict[str, Any]) -> None:
        lease_id = str(message.get("lease_id"))
        lease = self.leases.get(lease_id, time.monotonic())
        if lease is None:
            writer.write(encode(Frame.ERROR, {"message": f"lease {lease_id!r} is unknown or "
                                                         "expired"}))
            return
        writer.write(encode(Frame.LEASE, {"hashes": lease.hashes,
                                          "block_bytes": self.store.block_bytes}))
        await writer.drain()
        _, want = await expect(reader, Frame.WANT)
        wanted = [int(h) for h in want.get("hashes") or []]
        unknown = set(wanted) - set(lease.hashes)
        if unknown:
            raise ProtocolError(f"WANT names {len(unknown)} hashes outside lease {lease_id}")
        # A few blocks per lock hold: the engine steps in between, memory stays flat, and a
        # long prompt streams instead of being copied whole first.
        for start in range(0, len(wanted), READ_CHUNK_BLOCKS):
            chunk = wanted[start:start + READ_CHUNK_BLOCKS]
            with self.store.lock:
                datas = self.store.read(lease.pinned, chunk)
            for block_hash, data in zip(chunk, datas, strict=True):
                writer.writelines(encode_block(block_hash, data))
                await writer.drain()
        writer.write(encode(Frame.END))
        await writer.drain()
        await expect(reader, Frame.RELEASE)
        self._release(lease_id)

    def _release(self, lease_id: str) -> None:
        with self.store.lock:
            lease = self.leases.release(lease_id)
            if lease is not None:
                self.store.unpin(lease.pinned)

    # ---- decode side ------------------------------------------------------------------

    async def _serve_pull(self, message: dict[str, Any]) -> dict[str, Any]:
        host, _, port = str(message["remote"]).rpartition(":")
        lease_id, timeout = str(message["lease_id"]), float(message.get("timeout", 10.0))
        error: Exception | None = None
        for attempt in range(self.pull_attempts):
            try:
                return await asyncio.wait_for(self._pull(host, int(port), lease_id), timeout)
            except (OSError, ProtocolError, TimeoutError) as exc:
                error = exc
                log.warning("pull of lease %s from %s, attempt %d: %r", lease_id,
                            message["remote"], attempt + 1, exc)
                if isinstance(exc, ProtocolError) and "unknown or expired" in str(exc):
                    break  # retrying cannot bring it back
        raise ProtocolError(f"pull of lease {lease_id} from {message['remote']} failed: {error!r}")

    async def _pull(self, host: str, port: int, lease_id: str) -> dict[str, Any]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(encode(Frame.FETCH, {"lease_id": lease_id}))
            await writer.drain()
            _, lease = await expect(reader, Frame.LEASE)
            hashes = [int(h) for h in lease["hashes"]]
            with self.store.lock:
                have = self.store.num_cached_prefix(hashes)
            wanted = hashes[have:]
            writer.write(encode(Frame.WANT, {"hashes": wanted}))
            await writer.drain()
            blocks: list[tuple[int, memoryview]] = []
            while True:
                frame, payload = await read_frame(reader)
                if frame is Frame.END:
                    break
                if frame is not Frame.BLOCK:
                    raise ProtocolError(f"expected BLOCK or END, got {frame.name}")
                block_hash, data = decode_block(payload)
                if block_hash != wanted[len(blocks)] or len(data) != lease["block_bytes"]:
                    raise ProtocolError(f"block {len(blocks)} is not the one asked for")
                blocks.append((block_hash, data))
            with self.store.lock:
                imported = self.store.import_blocks(blocks, hashes[:have])
            writer.write(encode(Frame.RELEASE, {"lease_id": lease_id}))
            await writer.drain()
            return {"imported": imported, "skipped": have, "blocks": len(hashes)}
        finally:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    # ---- dispatch ---------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Gives the open leases, the blocks they pin, and the blocks the engine owns."""
        with self.store.lock:
            return {"leases": len(self.leases),
                    "leased_blocks": self.leases.num_blocks(),
                    "owned_blocks": self.store.owned_blocks()}

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            frame, message = await expect(reader, Frame.FETCH, Frame.PULL, Frame.STATS)
            if frame is Frame.STATS:
                writer.write(encode(Frame.STATS, self.stats()))
            elif frame is Frame.PULL:
                try:
                    done = await self._serve_pull(message)
                except ProtocolError as exc:
                    writer.write(encode(Frame.ERROR, {"message": str(exc)}))
                else:
                    writer.write(encode(Frame.DONE, done))
            else:
                await self._serve_fetch(reader, writer, message)
            await writer.drain()
        except (OSError, ProtocolError, ValueError, KeyError) as exc:
            log.warning("KV agent connection failed: %r", exc)
        finally:
            writer.close()
