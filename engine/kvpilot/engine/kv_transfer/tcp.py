"""The default KV connector: an asyncio TCP agent beside the engine, on its own thread.

One agent per engine serves both conversations of protocol.py: as a prefill
agent it answers FETCH (lease's hashes), WANT (stream the blocks) and RELEASE;
as a decode agent it answers the router's PULL by fetching from the prefill
agent, checking every block's checksum, and importing the blocks into the
engine's prefix cache. Blocks land in pooled host buffers and each buffer-full
is imported once its checksums pass (the lock held only for the pool
bookkeeping and enqueueing the cache writes), so a peer that vanishes
mid-transfer leaves the groups imported so far cached and unowned, nothing
allocated; on the prefill side the lease expires and unpins.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from kvpilot.engine.contracts.kv_auth import AUTH_TIMEOUT, accept_peer, prove_to_agent_sync
from kvpilot.engine.contracts.kv_client import NO_SECRET_KEY
from kvpilot.engine.contracts.kv_protocol import (
    Frame,
    ProtocolError,
    encode,
    encode_block,
    expect,
    expect_sync,
    hash_list,
    read_blocks_into,
    send_buffers,
    set_kernel_timeouts,
)
from kvpilot.engine.contracts.repeated_warnings import RepeatedWarnings
from kvpilot.engine.kv_transfer.connector import (
    BlockStore,
    BufferT,
    HandleT,
    KVTransport,
    PendingRead,
    StagedT,
)
from kvpilot.engine.kv_transfer.leases import Lease, LeaseTable
from kvpilot.engine.kv_transfer.nixl_agent import NixlAgent, NixlError
from kvpilot.engine.kv_transfer.nixl_pull import NixlPath, receive_by_nixl, slots_frame

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvpilot.kv_transfer")
FETCH_IO_TIMEOUT = 30.0  # a decode peer silent this long mid-transfer is gone (the lease expires)
EXPIRY_TICK = 0.5
MAX_PULL_TIMEOUT = 3600.0  # a PULL's deadline: far above any transfer, below forever
P = ParamSpec("P")
R = TypeVar("R")


class TcpConnector(KVTransport, Generic[HandleT, BufferT, StagedT]):
    """Serves FETCH/WANT/RELEASE (prefill) and PULL (decode) on host:port to peers that prove
    they hold `kv_key` (the fleet secret's; `kv_auth`), and proves it to the agents it pulls
    from. With a `nixl` agent the blocks move by NIXL READs where the peer offers them
    (`nixl_pull`), and by BLOCK frames where it does not or a READ failed."""

    def __init__(self, store: BlockStore[HandleT, BufferT, StagedT], host: str, port: int,
                 lease_seconds: float = 30.0, pull_attempts: int = 2,
                 kv_key: bytes = NO_SECRET_KEY, nixl: NixlAgent | None = None) -> None:
        self.store = store
        self.nixl = NixlPath(nixl) if nixl is not None else None
        self.transport = "nixl" if nixl is not None else "tcp"
        self.pulls = {"nixl": 0, "tcp": 0}  # pulls completed, by how their blocks moved
        self._kv_key = kv_key
        self.host, self.port = host, port
        self.leases: LeaseTable[HandleT] = LeaseTable(lease_seconds)
        # Guards `leases` and the reads of leased blocks. Taken after the store's lock where
        # both are needed, alone by reads and by the expiry tick: neither waits for a step.
        self._lease_lock = threading.Lock()
        self.pull_attempts = pull_attempts
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvpilot-kv-agent",
                                        daemon=True)
        self._server: asyncio.Server | None = None
        self._expiry: asyncio.Task[None] | None = None
        # a port scan is one line per peer and interval, not one per connection
        self._bad_connections = RepeatedWarnings(log, "bad KV agent connections")

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
            if self._server:
                self._server.close()
            # the expiry loop and every conversation still open end here, each closing its
            # connection, rather than being dropped with the loop (a worker thread copying for
            # one runs on until its socket's timeout)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=2)
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            if not self._thread.is_alive():
                self._loop.close()
        with self.store.lock, self._lease_lock:
            for lease in self.leases.expire(float("inf")):
                self.store.unpin(lease.pinned)
        if self.nixl is not None:
            self.nixl.agent.close()

    # ---- prefill side -----------------------------------------------------------------

    def offer(self, lease_id: str, token_ids: Sequence[int]) -> int:
        hashes, pinned = self.store.pin(token_ids)
        with self._lease_lock:
            replaced = self.leases.open(lease_id, hashes, pinned, time.monotonic())
            if replaced is not None:
                self.store.unpin(replaced.pinned)
        return len(hashes)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_TICK)
            self._bad_connections.flush()
            # the engine lock (held through each step) only when a lease did expire: this
            # loop also accepts the connections. Out of the table, a lease takes no new
            # reads, and `unpin` orders itself after the ones enqueued.
            with self._lease_lock:
                expired = self.leases.expire(time.monotonic())
            if expired:
                with self.store.lock:
                    for lease in expired:
                        log.warning("lease %s expired unpulled: unpinning %d blocks",
                                    lease.lease_id, len(lease.hashes))
                        self.store.unpin(lease.pinned)

    def _serve_fetch(self, sock: socket.socket, message: dict[str, Any]) -> None:
        """Answers one FETCH conversation on a blocking socket (a worker thread).

        Chunks of blocks are read from the engine without its lock (enqueueing their copy
        to host memory; the next chunk copies while this one is sent) and sent by
        scatter-gather writes straight from the host buffer.
        """
        lease_id = str(message.get("lease_id"))
        with self._lease_lock:
            lease = self.leases.get(lease_id, time.monotonic())
        if lease is None:
            sock.sendall(encode(Frame.ERROR, {"message": f"lease {lease_id!r} is unknown or "
                                                        "expired"}))
            return
        offer = self.nixl.offer(message) if self.nixl is not None else {}
        sock.sendall(encode(Frame.LEASE, {"hashes": lease.hashes,
                                          "block_bytes": self.store.block_bytes, **offer}))
        _, want = expect_sync(sock, Frame.WANT)
        wanted = hash_list(want, "hashes")
        unknown = set(wanted) - set(lease.hashes)
        if unknown:
            raise ProtocolError(f"WANT names {len(unknown)} hashes outside lease {lease_id}")
        if want.get("nixl") and offer and self.nixl is not None:
            # the decode side READs the blocks (packed into send-region rows when there is
            # room); they stay pinned, and the rows taken, until its RELEASE
            region = self.nixl.agent.region
            with region.rows_for(len(wanted)) if region is not None else nullcontext() as held:
                first, out = held if held is not None else (None, None)
                sock.sendall(slots_frame(*self._slots(lease, wanted, out), region_row=first))
                expect_sync(sock, Frame.RELEASE)
            self._release(lease_id)
            return
        size = self.store.read_chunk_blocks
        chunks = [wanted[i:i + size] for i in range(0, len(wanted), size)]
        pending: list[PendingRead] = []
        try:
            for index, chunk in enumerate(chunks):
                if not pending:
                    pending.append(self._read(lease, chunk))
                if index + 1 < len(chunks):
                    pending.append(self._read(lease, chunks[index + 1]))
                datas = pending[0].wait()
                frames: list[bytes | memoryview] = []
                for block_hash, data, digest in zip(chunk, datas, pending[0].checksums(),
                                                    strict=True):
                    frames += encode_block(block_hash, data, digest)
                send_buffers(sock, frames)  # returns once the kernel has every byte
                pending.pop(0).release()
        finally:
            for read in pending:
                read.wait()  # the copy must land before its buffer is reused
                read.release()
        sock.sendall(encode(Frame.END))
        expect_sync(sock, Frame.RELEASE)
        self._release(lease_id)

    def _read(self, lease: Lease[HandleT], hashes: list[int]) -> PendingRead:
        """Starts copying a chunk of a live lease's blocks (enqueue only). The lease lock
        keeps the blocks pinned meanwhile; the engine lock is not needed, so a read does
        not wait for the prefill engine's step."""
        with self._lease_lock:
            if self.leases.get(lease.lease_id, time.monotonic()) is not lease:
                raise ProtocolError(f"lease {lease.lease_id!r} expired mid-transfer")
            return self.store.read(lease.pinned, hashes)

    def _slots(self, lease: Lease[HandleT], hashes: list[int], out: torch.Tensor | None
               ) -> tuple[list[int], list[bytes]]:
        """Gives a live lease's blocks' ids and checksums, packed into `out` when given (as
        `_read`, under the lease lock)."""
        with self._lease_lock:
            if self.leases.get(lease.lease_id, time.monotonic()) is not lease:
                raise ProtocolError(f"lease {lease.lease_id!r} expired mid-transfer")
            return self.store.slots(lease.pinned, hashes, out)

    def _release(self, lease_id: str) -> None:
        with self.store.lock, self._lease_lock:
            lease = self.leases.release(lease_id)
            if lease is not None:
                self.store.unpin(lease.pinned)

    # ---- decode side ------------------------------------------------------------------

    async def _serve_pull(self, message: dict[str, Any]) -> dict[str, Any]:
        host, port, lease_id, timeout = pull_request(message)
        deadline = time.monotonic() + timeout
        error: Exception | None = None
        for attempt in range(self.pull_attempts):
            if time.monotonic() >= deadline:
                break
            try:
                return await self._in_worker(self._pull, host, port, lease_id, deadline)
            except (OSError, ProtocolError, TimeoutError) as exc:
                error = exc
                if isinstance(exc, NixlError) and self.nixl is not None:
                    self.nixl.fail(str(message["remote"]))  # the retry moves by TCP
                log.warning("pull of lease %s from %s, attempt %d: %r", lease_id,
                            message["remote"], attempt + 1, exc)
                if isinstance(exc, ProtocolError) and "unknown or expired" in str(exc):
                    break  # retrying cannot bring it back
        raise ProtocolError(f"pull of lease {lease_id} from {message['remote']} failed: "
                            f"{error or TimeoutError()!r}")

    def _pull(self, host: str, port: int, lease_id: str, deadline: float) -> dict[str, Any]:
        """Pulls one lease on a blocking socket (a worker thread), by `deadline`.

        Blocks land by scatter reads straight in the rows of a pooled receive buffer
        (`_receive`); each socket call waits at most until the deadline.
        """
        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"pull of lease {lease_id} ran past its timeout")
            return left

        with socket.create_connection((host, port), timeout=remaining()) as sock:
            # blocking, with the deadline as kernel timeouts: a Python-level timeout makes the
            # socket non-blocking and MSG_WAITALL would return after every partial read
            sock.settimeout(None)
            # small frames back to back (the proof, then FETCH) must not wait for the peer's
            # delayed ACK (Nagle's algorithm): ~40 ms a pull on Linux without this
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_kernel_timeouts(sock, remaining())
            prove_to_agent_sync(sock, self._kv_key)
            remote = f"{host}:{port}"
            nixl = self.nixl if self.nixl is not None and self.nixl.ask(remote) else None
            sock.sendall(encode(Frame.FETCH, {"lease_id": lease_id,
                                              **({"nixl": True} if nixl else {})}))
            _, lease = expect_sync(sock, Frame.LEASE)
            hashes = hash_list(lease, "hashes")
            with self.store.lock:
                have = self.store.num_cached_prefix(hashes)
            wanted = hashes[have:]
            size = self.store.block_bytes
            if wanted and lease.get("block_bytes") != size:
                raise ProtocolError(f"the peer's blocks are {lease.get('block_bytes')} bytes, this "
                                    f"engine's {size}: a different model, dtype or block size")
            peer = nixl.peer(lease, remote) if nixl is not None and wanted else None
            sock.sendall(encode(Frame.WANT, {"hashes": wanted,
                                             **({"nixl": True} if peer else {})}))
            if peer is not None and nixl is not None:
                imported = receive_by_nixl(sock, nixl.agent, *peer, self.store, hashes[:have],
                                           wanted, remaining, import_group)
            else:
                imported = self._receive(sock, hashes[:have], wanted, remaining) if wanted else 0
                set_kernel_timeouts(sock, remaining())
                expect_sync(sock, Frame.END)
            remaining()
            sock.sendall(encode(Frame.RELEASE, {"lease_id": lease_id}))
            transport = "nixl" if peer is not None else "tcp"
            self.pulls[transport] += 1
            return {"imported": imported, "skipped": have, "blocks": len(hashes),
                    "transport": transport}

    def _receive(self, sock: socket.socket, prefix: list[int], wanted: list[int],
                 remaining: Callable[[], float]) -> int:
        """Receives the wanted blocks a buffer-full at a time, importing each group once its
        checksums pass; gives how many went in.

        A group lands by scatter reads straight into a pooled host buffer and goes in by
        `import_group`. At most two groups' device staging is alive at once.
        After a group that did not fit (the pool is full) the rest is received and
        dropped: later blocks would not extend the prefix. A peer that vanishes
        mid-transfer leaves the groups imported so far as cached, unowned blocks,
        evictable like a finished prompt's; nothing stays allocated.
        """
        buffer = self.store.receive_buffer(remaining())
        imported, full, previous = 0, False, None
        try:
            for start in range(0, len(wanted), buffer.capacity):
                group = wanted[start:start + buffer.capacity]
                heads = read_blocks_into(sock, [buffer.block(i) for i in range(len(group))],
                                         remaining)
                for count, ((block_hash, _), expected) in enumerate(zip(heads, group,
                                                                        strict=True)):
                    if block_hash != expected:
                        raise ProtocolError(f"block {start + count} is not the one asked for")
                if full:
                    continue
                count, full, staged = import_group(self.store, buffer, group,
                                                   [digest for _, digest in heads],
                                                   [*prefix, *wanted[:start]])
                imported += count
                if previous is not None:
                    previous.wait()
                previous = staged
        finally:
            buffer.release()
        return imported

    # ---- dispatch ---------------------------------------------------------------------

    async def _in_worker(self, function: Callable[P, R], *args: P.args, **kwargs: P.kwargs
                         ) -> R:
        """Runs one transfer conversation in a worker thread, counted while it runs."""
        self.transfers_running += 1  # on the agent's event loop only
        try:
            return await asyncio.to_thread(function, *args, **kwargs)
        finally:
            self.transfers_running -= 1

    def stats(self) -> dict[str, int]:
        """Gives the open leases, the blocks they pin, and the blocks the engine owns."""
        with self.store.lock, self._lease_lock:
            return {"leases": len(self.leases),
                    "leased_blocks": self.leases.num_blocks(),
                    "owned_blocks": self.store.owned_blocks()}

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            # nothing is read past the handshake from a peer without the fleet's secret
            await asyncio.wait_for(accept_peer(reader, writer, self._kv_key), AUTH_TIMEOUT)
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
                # the rest of the conversation runs in a worker thread on a blocking copy of
                # the socket; the transport stops reading so it cannot take those bytes
                # typeshed gives StreamWriter.transport as a WriteTransport; a server
                # connection's is a socket transport, which reads too
                writer.transport.pause_reading()  # pyright: ignore[reportAttributeAccessIssue]
                with _blocking_copy(writer) as sock:
                    await self._in_worker(self._serve_fetch, sock, message)
            await writer.drain()
        except (OSError, ProtocolError, ValueError, KeyError, TimeoutError) as exc:
            peer = writer.get_extra_info("peername")
            self._bad_connections.warn(str(peer[0]) if peer else "an unknown peer",
                                       "KV agent connection from %s failed: %r", peer, exc)
        finally:
            writer.close()


def pull_request(message: dict[str, Any]) -> tuple[str, int, str, float]:
    """Gives (host, port, lease id, timeout seconds) of a PULL message; raises ProtocolError
    naming the field (answered to the asker as an ERROR frame) when one is malformed."""
    remote, lease_id = message.get("remote"), message.get("lease_id")
    host, _, port = remote.rpartition(":") if isinstance(remote, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ProtocolError(f"PULL remote={remote!r} is invalid: give the prefill agent's "
                            "host:port")
    if not isinstance(lease_id, str) or not lease_id:
        raise ProtocolError(f"PULL lease_id={lease_id!r} is invalid: give the lease's id")
    timeout = message.get("timeout", 10.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
            or not 0 < timeout <= MAX_PULL_TIMEOUT:
        raise ProtocolError(f"PULL timeout={timeout!r} is invalid: give seconds in "
                            f"(0, {MAX_PULL_TIMEOUT}]")
    return host, int(port), lease_id, float(timeout)


def import_group(store: BlockStore[HandleT, BufferT, StagedT], buffer: BufferT,
                 hashes: list[int], digests: Sequence[bytes], prefix: Sequence[int]
                 ) -> tuple[int, bool, StagedT]:
    """Imports the first len(hashes) blocks of a filled receive buffer after `prefix`: staged
    toward the device and checked there without the lock (a mismatch raises before anything
    goes in), then imported under it. Gives (how many went in, whether some did not fit,
    the staging: wait for it before the device memory is reused)."""
    staged = store.stage(buffer, hashes)
    store.verify(staged, digests)
    with store.lock:
        imported = store.import_blocks(staged, prefix)
        full = store.num_cached_prefix(hashes) < len(hashes)
    return imported, full, staged


def _blocking_copy(writer: asyncio.StreamWriter) -> socket.socket:
    """Gives a blocking socket on a duplicate of the connection's descriptor (close it after)."""
    raw = writer.get_extra_info("socket")
    sock = socket.socket(fileno=os.dup(raw.fileno()))
    sock.settimeout(FETCH_IO_TIMEOUT)  # blocking with a timeout, on the shared non-blocking fd
    return sock

