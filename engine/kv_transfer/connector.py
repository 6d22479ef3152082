"""What a KV connector does, and what it needs from the engine; no transport details here."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol


class BlockStore(Protocol):
    """The engine's KV cache as the connector sees it: pin, read, probe and import by hash.

    Every method must be called with `lock` held: the engine thread holds it
    while it steps, so the connector's thread never races a forward pass.
    """

    lock: threading.RLock
    block_bytes: int

    def pin(self, token_ids: Sequence[int]) -> tuple[list[int], Any]:
        """Gives (hashes, handle) of the prompt's cached leading full blocks, now pinned."""
        ...

    def unpin(self, handle: Any) -> None:
        """Drops the pins `pin` took."""
        ...

    def read(self, handle: Any, hashes: Sequence[int]) -> list[bytes]:
        """Gives the data of the pinned blocks with these hashes, in order."""
        ...

    def num_cached_prefix(self, hashes: Sequence[int]) -> int:
        """Gives how many leading hashes this engine's prefix cache already holds."""
        ...

    def owned_blocks(self) -> int:
        """Gives how many blocks something holds (requests or leases): 0 when idle."""
        ...

    def import_blocks(self, blocks: Sequence[tuple[int, bytes | memoryview]],
                      prefix_hashes: Sequence[int] = ()) -> int:
        """Writes blocks into free slots as cached (keeping `prefix_hashes` cached meanwhile);
        gives how many it wrote."""
        ...


class KVConnector(ABC):
    """Moves finished prefills' KV blocks to decode engines.

    The prefill side `offer`s each finished prompt (its blocks stay pinned under
    a lease until pulled or expired); the decode side pulls a lease when the
    router asks it to, before the request itself arrives.
    """

    @abstractmethod
    def start(self) -> None:
        """Starts serving (listener, lease expiry)."""

    @abstractmethod
    def stop(self) -> None:
        """Stops serving and unpins everything still leased."""

    @abstractmethod
    def offer(self, lease_id: str, token_ids: Sequence[int]) -> int:
        """Pins a finished prompt's blocks under a lease (call with the store's lock held);
        gives the number of blocks pinned."""
