"""The NIXL half of a pull conversation: SLOTS out (prefill side), READs in (decode side).

The TCP agent keeps the conversation (handshake, FETCH, LEASE, WANT, RELEASE) and the
lease; only the bytes move differently. The prefill side answers a `"nixl": true`
WANT with SLOTS: the wanted blocks packed into rows of its send region
(`nixl_region`, so a few large descriptors move them), or, when the region has no
room, their ids in its caches; and their checksums, computed on its device from the
blocks it pins. The decode side READs them, a receive
buffer-full per transfer, and imports each group exactly as a TCP pull does
(`tcp.import_group`): the checksums are checked before anything is read (on the
device at load, for a decode engine's host tier), so a block overwritten or cut
short mid-READ is recomputed, never used.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvpilot.engine.contracts.kv_protocol import Frame, ProtocolError, encode, expect_sync
from kvpilot.engine.kv_transfer.connector import BlockStore, BufferT, HandleT, StagedT
from kvpilot.engine.kv_transfer.nixl_agent import NixlAgent, NixlError, NixlTimeout
from kvpilot.engine.kv_transfer.nixl_layout import CacheLayout

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvpilot.kv_transfer")
NIXL_RETRY_S = 60.0  # after a failed NIXL READ from a peer, pulls from it use TCP this long


def slots_frame(block_ids: Sequence[int], digests: Sequence[bytes],
                region_row: int | None = None) -> bytes:
    """Gives the SLOTS frame that tells a decode side where to READ the wanted blocks: from
    send-region rows `region_row`, `region_row + 1`, ... when packed there, else from the
    caches' `block_ids`."""
    return encode(Frame.SLOTS, {"block_ids": list(block_ids),
                                "checksums": [d.hex() for d in digests],
                                **({} if region_row is None else {"region_row": region_row})})


def parse_slots(message: dict[str, Any], count: int
                ) -> tuple[list[int], list[bytes], int | None]:
    """Gives (block ids, checksum fields, first send-region row or None) of a SLOTS message
    for `count` wanted blocks."""
    try:
        ids = [int(b) for b in message["block_ids"]]
        digests = [bytes.fromhex(d) for d in message["checksums"]]
        region_row = None if message.get("region_row") is None else int(message["region_row"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed SLOTS frame: {exc!r}") from exc
    if len(ids) != count or len(digests) != count or any(len(d) != 8 for d in digests):
        raise ProtocolError(f"SLOTS names {len(ids)} blocks and {len(digests)} checksums "
                            f"for {count} wanted blocks")
    return ids, digests, region_row


class Source:
    """Where a pull's wanted blocks are read from: the peer's send-region rows
    `region_row + i` when it packed them there, else its cache blocks `ids[i]`."""

    def __init__(self, agent: NixlAgent, peer: str, layout: CacheLayout, ids: list[int],
                 region_row: int | None) -> None:
        self.agent, self.peer, self.layout = agent, peer, layout
        self.ids, self.region_row = ids, region_row

    def read(self, wanted: list[int], rows: torch.Tensor, timeout: float,
             at: list[int] | None = None) -> None:
        """READs wanted blocks (positions in the pull's WANT) into rows `at` of `rows`."""
        if self.region_row is None:
            self.agent.read(self.peer, self.layout, [self.ids[i] for i in wanted], rows,
                            timeout, at)
        else:
            self.agent.read_rows(self.peer, self.layout, [self.region_row + i for i in wanted],
                                 rows, timeout, at)


@runtime_checkable
class DirectLanding(Protocol):
    """A store whose destination rows a READ can write in place (a decode engine's host
    tier, `LandingStore`): no receive buffer, no copy after the READ."""

    def reserve(self, hashes: Sequence[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Gives the rows tensor and (hash, row) of each hash not held, as far as room goes."""
        ...

    def land(self, entries: list[tuple[int, int]], digests: Sequence[bytes]) -> None:
        """Makes written rows findable, with their checksums."""
        ...

    def abandon(self, entries: list[tuple[int, int]]) -> None:
        """Gives reserved rows back unwritten."""
        ...


def land_in_place(source: Source, store: DirectLanding, wanted: list[int],
                  digests: list[bytes], remaining: Callable[[], float]) -> int:
    """READs the wanted blocks the store has room for straight into its rows, in one
    transfer; gives how many landed. A failed READ gives its rows back; one still running
    at the deadline keeps them reserved (the peer may still write them), never findable."""
    rows, entries = store.reserve(wanted)
    if not entries:
        return 0
    position = {block_hash: index for index, block_hash in enumerate(wanted)}
    picked = [position[block_hash] for block_hash, _ in entries]
    try:
        source.read(picked, rows, remaining(), at=[row for _, row in entries])
    except NixlTimeout:
        log.warning("%d host-tier rows stay reserved after a NIXL READ timed out", len(entries))
        raise
    except BaseException:
        store.abandon(entries)
        raise
    store.land(entries, [digests[i] for i in picked])
    return len(entries)


def receive_by_nixl(sock: socket.socket, agent: NixlAgent, peer: str, layout: CacheLayout,
                    store: BlockStore[HandleT, BufferT, StagedT], prefix: list[int],
                    wanted: list[int], remaining: Callable[[], float],
                    import_group: Callable[..., tuple[int, bool, StagedT]]) -> int:
    """Reads the wanted blocks after SLOTS by NIXL, straight into a `DirectLanding` store's
    rows (one READ), else a receive buffer-full per READ, importing each group once read;
    gives how many went in.

    A READ still running at the deadline leaves its buffer out of the pool (the peer
    may still write it); any NIXL failure raises NixlError, which the caller answers by
    retrying over TCP. Groups imported before a failure stay, as in a TCP pull.
    """
    _, message = expect_sync(sock, Frame.SLOTS)
    ids, digests, region_row = parse_slots(message, len(wanted))
    source = Source(agent, peer, layout, ids, region_row)
    if isinstance(store, DirectLanding):
        return land_in_place(source, store, wanted, digests, remaining)
    buffer = store.receive_buffer(remaining())
    imported, previous, abandoned = 0, None, False
    try:
        for start in range(0, len(wanted), buffer.capacity):
            group = wanted[start:start + buffer.capacity]
            rows = buffer.tensor[:len(group)]
            try:
                source.read(list(range(start, start + len(group))), rows, remaining())
            except NixlTimeout:
                abandoned = True
                raise
            count, full, staged = import_group(store, buffer, group,
                                               digests[start:start + len(group)],
                                               [*prefix, *wanted[:start]])
            imported += count
            if previous is not None:
                previous.wait()
            previous = staged
            if full:
                break  # later blocks would not extend the prefix: not read at all
        if previous is not None:
            previous.wait()
    finally:
        if not abandoned:
            buffer.release()
    return imported


class NixlPath:
    """A KV agent's NIXL side: what its LEASE offers, which peers to ask for NIXL, the peer a
    LEASE offers; a peer whose READ failed is pulled by TCP for `retry_s`."""

    def __init__(self, agent: NixlAgent, retry_s: float = NIXL_RETRY_S) -> None:
        self.agent, self.retry_s = agent, retry_s
        self.failed: dict[str, float] = {}  # peer "host:port" -> when its NIXL failed

    def offer(self, fetch: dict[str, Any]) -> dict[str, Any]:
        """Gives the LEASE frame's `nixl` part for a FETCH that asks for it (a prefill agent's
        registered caches), else nothing."""
        if not fetch.get("nixl") or self.agent.layout is None:
            return {}
        return {"nixl": self.agent.offer()}

    def ask(self, remote: str) -> bool:
        """Gives whether to ask the peer at `remote` for NIXL (not within `retry_s` of a
        failure)."""
        return time.monotonic() - self.failed.get(remote, -self.retry_s) >= self.retry_s

    def fail(self, remote: str) -> None:
        self.failed[remote] = time.monotonic()

    def peer(self, lease: dict[str, Any], remote: str) -> tuple[str, CacheLayout] | None:
        """Gives the NIXL peer a LEASE offers (added to this agent), or None: the blocks then
        move by TCP (logged: the peer offers no NIXL, or it cannot be added)."""
        offer = lease.get("nixl")
        if not offer:
            log.info("pull from %s moves by TCP: the peer offers no NIXL", remote)
            return None
        try:
            return self.agent.connect(offer)
        except NixlError as exc:
            self.fail(remote)
            log.warning("pull from %s moves by TCP: %s", remote, exc)
            return None
