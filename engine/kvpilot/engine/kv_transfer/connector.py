"""What a KV transport between engines does, and what it needs from the engine's store; no
wire details here. The engine's own seam is `kv_connector.base.KVConnector`: a decode
engine's transport lands pulled blocks in its host tier (`kv_connector.landing_store`),
where the scheduler finds them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    import torch


class PendingRead(Protocol):
    """Blocks `BlockStore.read` is copying into a host buffer."""

    def wait(self) -> list[memoryview]:
        """Blocks until copied (call without the lock); gives each block's wire data."""
        ...

    def checksums(self) -> list[bytes]:
        """Gives each block's `protocol.checksum` field (after `wait`)."""
        ...

    def release(self) -> None:
        """Gives the host buffer back for reuse, once the data `wait` gave is sent."""
        ...


class ReceiveBuffer(Protocol):
    """A pooled host buffer for up to `capacity` blocks of a pull, filled as they arrive."""

    capacity: int
    tensor: torch.Tensor  # uint8 [capacity, block_bytes] host memory (NIXL reads into it)

    def block(self, index: int) -> memoryview:
        """Gives block `index`'s bytes (`block_bytes` long), writable."""
        ...

    def release(self) -> None:
        """Gives the buffer back to its pool (after the last `verify`/`import_blocks` of it)."""
        ...


class StagedBlocks(Protocol):
    """Received blocks on their way to the cache (`BlockStore.stage`)."""

    def wait(self) -> None:
        """Blocks until the cache writes `import_blocks` enqueued have run (without the lock)."""
        ...


HandleT = TypeVar("HandleT")  # what `pin` gives and `unpin` and `read` take
BufferT = TypeVar("BufferT", bound=ReceiveBuffer)
StagedT = TypeVar("StagedT", bound=StagedBlocks)


class BlockStore(Protocol[HandleT, BufferT, StagedT]):
    """The engine's KV cache as the connector sees it: pin, read, probe and import by hash.

    The engine thread holds `lock` while it steps. `pin`, `unpin`,
    `num_cached_prefix`, `owned_blocks` and `import_blocks` must be called with it
    held, so the connector's thread never races the engine's bookkeeping;
    `import_blocks` only enqueues its copies there (on a GPU), so the lock is held
    for bookkeeping, not for moving data. `read` is called without it, on blocks
    the caller keeps pinned meanwhile (a busy prefill engine would make every read
    wait a step for the lock); `receive_buffer`, `stage` and the waits of what
    `read` and `stage` give are called without it too.
    """

    block_bytes: int
    read_chunk_blocks: int  # most blocks one `read` should be asked for

    @property
    def lock(self) -> AbstractContextManager[object]:
        """Gives the reentrant lock the engine steps under (FairLock in engines: a waiting
        agent is not starved by steps)."""
        ...

    def pin(self, token_ids: Sequence[int]) -> tuple[list[int], HandleT]:
        """Gives (hashes, handle) of the prompt's cached leading full blocks, now pinned."""
        ...

    def unpin(self, handle: HandleT) -> None:
        """Drops the pins `pin` took."""
        ...

    def read(self, handle: HandleT, hashes: Sequence[int]) -> PendingRead:
        """Starts copying the pinned blocks with these hashes, in order, into a host buffer
        (no lock; `handle` stays pinned until the call returns)."""
        ...

    def slots(self, handle: HandleT, hashes: Sequence[int],
              out: torch.Tensor | None = None) -> tuple[list[int], list[bytes]]:
        """Gives the pinned blocks' ids in the caches and their checksum fields, for a peer
        that reads them by NIXL (no lock; `handle` stays pinned until the call returns),
        with the blocks packed into `out`'s rows (a NIXL send region's) when given."""
        ...

    def num_cached_prefix(self, hashes: Sequence[int]) -> int:
        """Gives how many leading hashes this engine's prefix cache already holds."""
        ...

    def owned_blocks(self) -> int:
        """Gives how many blocks something holds (requests or leases): 0 when idle."""
        ...

    def receive_buffer(self, timeout: float) -> BufferT:
        """Gives a host buffer from a bounded pool, waiting up to `timeout` seconds while all
        are in use (TimeoutError); no lock."""
        ...

    def stage(self, buffer: BufferT, hashes: Sequence[int]) -> StagedT:
        """Starts moving the first len(hashes) blocks of `buffer`, which hold `hashes`, toward
        the cache's device (no lock)."""
        ...

    def verify(self, staged: StagedT, digests: Sequence[bytes]) -> None:
        """Raises ProtocolError unless each staged block matches its frame's checksum field
        (no lock)."""
        ...

    def import_blocks(self, staged: StagedT, prefix_hashes: Sequence[int] = ()) -> int:
        """Writes staged blocks into free slots as cached (keeping `prefix_hashes` cached
        meanwhile), skipping those already cached; only the leading ones that fit go in.
        Gives how many it wrote."""
        ...


class KVTransport(ABC):
    """Moves finished prefills' KV blocks to decode engines.

    The prefill side `offer`s each finished prompt (its blocks stay pinned under
    a lease until pulled or expired); the decode side pulls a lease when the
    router asks it to, before the request itself arrives.
    """

    transfers_running = 0  # conversations moving blocks now (the slow-iteration log names it)
    transport = "tcp"  # how pulls move blocks when the peer agrees: "tcp" or "nixl"
    pulls: dict[str, int]  # completed pulls by the transport that moved their blocks

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
