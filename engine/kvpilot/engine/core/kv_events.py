"""A bounded log of the prefix cache's changes (blocks stored and evicted), read by polling.

The block pool appends one int per event: a block hash ``h`` when a full block
is cached, ``~h`` (negative, since hashes are unsigned 64-bit) when it is
evicted, and ``CLEARED`` when the whole cache is forgotten; a block stored in or
dropped from the host-memory tier (`kv_connector.host_pool`) is the pair
``(HOST, h)`` or ``(HOST, ~h)``. Events carry a
monotonically increasing sequence number; the ring keeps the last `capacity`.

One thread writes (the engine thread, or whoever holds the engine lock); HTTP
handlers read without a lock: a reader notes `next`, copies the slots, then
checks that none of them was overwritten meanwhile, and answers "cleared"
(resync) when it fell behind.
"""

from __future__ import annotations

from typing import Any

CLEARED = None  # the slot value of a `cleared` event
HOST = "host"  # the tier a paired slot value names (a bare int is the GPU prefix cache)
DEFAULT_CAPACITY = 65_536


class KVEventLog:
    """Ring buffer of the last `capacity` prefix-cache events, numbered from 0."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity!r} is invalid: must be at least 1")
        self.capacity = capacity
        self._slots: list[int | tuple[str, int] | None] = [0] * capacity
        self.next = 0  # sequence number of the next event

    def stored(self, block_hash: int, host: bool = False) -> None:
        """Records that the block with `block_hash` is now cached (in host memory if `host`)."""
        self._slots[self.next % self.capacity] = (HOST, block_hash) if host else block_hash
        self.next += 1  # after the slot write: a reader never sees a number without its event

    def removed(self, block_hash: int, host: bool = False) -> None:
        """Records that the block with `block_hash` was evicted (from host memory if `host`)."""
        self._slots[self.next % self.capacity] = (HOST, ~block_hash) if host else ~block_hash
        self.next += 1

    def cleared(self) -> None:
        """Records that every cached block was forgotten."""
        self._slots[self.next % self.capacity] = CLEARED
        self.next += 1

    def read(self, since: int, limit: int | None = None) -> dict[str, Any]:
        """Gives ``{"next": M, "events": [...]}`` with the events numbered since..M-1.

        Events are runs in the router's ``POST /kv_events`` format, in order:
        ``{"stored": [h, ...]}``, ``{"removed": [h, ...]}``, ``{"cleared": True}``; runs
        of the host tier add ``"tier": "host"``.
        A reader that fell behind the ring (or asks past `next`, as after an engine
        restart) first gets ``{"cleared": True}`` and then every event still held, so
        it resets its view of this engine and resyncs.
        """
        end = self.next
        start, gap = since, since < end - self.capacity or since > end or since < 0
        if gap:
            start = max(0, end - self.capacity)
        if limit is not None:
            end = min(end, start + limit)
        slots = [self._slots[i % self.capacity] for i in range(start, end)]
        if start < self.next - self.capacity:  # the writer lapped us while we copied
            return self.read(since=-1, limit=limit)
        events: list[dict[str, Any]] = [{"cleared": True}] if gap else []
        for value in slots:
            if value is None:  # CLEARED
                events.append({"cleared": True})
                continue
            tier, value = value if isinstance(value, tuple) else (None, value)
            kind, block_hash = ("stored", value) if value >= 0 else ("removed", ~value)
            if events and kind in events[-1] and events[-1].get("tier") == tier:
                events[-1][kind].append(block_hash)
            else:
                events.append({kind: [block_hash]} if tier is None
                              else {kind: [block_hash], "tier": tier})
        return {"next": end, "events": events}
