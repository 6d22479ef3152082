"""Pooled host buffers that pulled KV blocks land in (pinned on CUDA), reused across pulls.

Pinning memory while an engine serves is the suspect in measured multi-second
stalls of the engine beside it, so a decode engine makes its buffers once, at
start-up (`BufferPool.fill`), and a pull waits for a free one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

PooledT = TypeVar("PooledT")


class ReceiveBuffer:
    """A pooled host buffer (pinned on CUDA) for up to `capacity` incoming blocks, block i at
    row i; `release` gives it back to the pool."""

    def __init__(self, tensor: torch.Tensor, pool: BufferPool[ReceiveBuffer]) -> None:
        self.tensor = tensor  # uint8 [capacity, block_bytes]
        self.capacity: int = tensor.shape[0]
        self._view = tensor.view(-1).numpy().data
        self._size = tensor.shape[1]
        self._pool = pool

    def block(self, index: int) -> memoryview:
        """Gives block `index`'s bytes, writable."""
        return self._view[index * self._size:(index + 1) * self._size]

    def release(self) -> None:
        self._pool.put(self)


class BufferPool(Generic[PooledT]):
    """At most `limit` buffers made by `make` and reused; `get` waits while all are out."""

    def __init__(self, make: Callable[[BufferPool[PooledT]], PooledT], limit: int) -> None:
        self._make, self._limit = make, limit
        self._free: list[PooledT] = []
        self._made = 0
        self._cond = threading.Condition()

    def fill(self) -> None:
        """Makes every buffer now, at start-up: pinning memory mid-serving is the suspect
        in measured multi-second stalls of the engine beside it."""
        with self._cond:
            missing = self._limit - self._made
            self._made = self._limit  # reserved: a `get` meanwhile waits instead of making one
        made: list[PooledT] = []
        try:
            for _ in range(missing):
                made.append(self._make(self))
        finally:
            with self._cond:
                self._made -= missing - len(made)
                self._free += made
                self._cond.notify_all()

    def get(self, timeout: float) -> PooledT:
        """Gives a free buffer, a new one while fewer than `limit` exist, else waits for one
        up to `timeout` seconds (TimeoutError)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._free and self._made >= self._limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"all {self._limit} receive buffers stayed in use")
                self._cond.wait(left)
            if self._free:
                return self._free.pop()
            self._made += 1
        try:
            return self._make(self)
        except BaseException:
            with self._cond:
                self._made -= 1
                self._cond.notify()
            raise

    def put(self, buffer: PooledT) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()
