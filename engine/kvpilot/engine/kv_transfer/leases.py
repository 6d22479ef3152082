"""Leases on pinned KV blocks: a prefill engine holds a finished prompt's blocks until the
decode side releases them or the lease expires, so a vanished peer never leaks blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

Pinned = TypeVar("Pinned")


@dataclass
class Lease(Generic[Pinned]):
    """The blocks one finished prefill pinned, by hash, and when they go back."""

    lease_id: str
    hashes: list[int]
    pinned: Pinned  # whatever the block store needs to unpin them
    expires_at: float


class LeaseTable(Generic[Pinned]):
    """Open leases by id; the caller unpins what `release` and `expire` give back."""

    def __init__(self, lease_seconds: float) -> None:
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds={lease_seconds!r} is invalid: must be > 0")
        self.lease_seconds = lease_seconds
        self._leases: dict[str, Lease[Pinned]] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def num_blocks(self) -> int:
        """Gives how many blocks the open leases name (a block may count once per lease)."""
        return sum(len(lease.hashes) for lease in self._leases.values())

    def open(self, lease_id: str, hashes: list[int], pinned: Pinned, now: float
             ) -> Lease[Pinned] | None:
        """Records a lease; gives the one it replaces (same id), which the caller unpins."""
        old = self._leases.pop(lease_id, None)
        self._leases[lease_id] = Lease(lease_id, hashes, pinned, now + self.lease_seconds)
        return old

    def get(self, lease_id: str, now: float) -> Lease[Pinned] | None:
        """Gives a live lease, or None when unknown or expired."""
        lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.expires_at > now else None

    def release(self, lease_id: str) -> Lease[Pinned] | None:
        """Closes a lease; gives it (to unpin) or None when already gone."""
        return self._leases.pop(lease_id, None)

    def expire(self, now: float) -> list[Lease[Pinned]]:
        """Closes and gives every lease whose time is up."""
        done = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in done:
            del self._leases[lease.lease_id]
        return done
