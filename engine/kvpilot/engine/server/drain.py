"""Admission and graceful drain: who may start a generation, and waiting for the rest to end.

A generation is counted from admission until its response's last byte is
handed to the server, so a drain waits for streams to be *sent*, not only
generated. On SIGTERM the gate closes (`/ready` answers 503, new generations
get 503), in-flight ones run to completion or until the drain timeout, and
then the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvpilot.engine.server.errors import OpenAIError

logger = logging.getLogger(__name__)
# ends a stream a router can resume elsewhere, once a drain's handover timeout passed
HANDOVER_MESSAGE = ("the server is draining and handed this stream over: a router resumes it "
                    "on another replica")


class Gate:
    """Admits generations unless draining or the engine's waiting queue is full."""

    def __init__(self, max_queue_len: int, num_waiting: Callable[[], int],
                 on_drain: Callable[[bool], None] | None = None) -> None:
        self.max_queue_len = max_queue_len
        self._num_waiting = num_waiting
        self._on_drain = on_drain
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self) -> None:
        """Counts one more generation in flight, or raises 503 (draining) / 429 (queue full)."""
        if self.draining:
            raise OpenAIError(503, "the server is draining and accepts no new requests: "
                              "retry on another replica", code="draining")
        waiting = self._num_waiting()
        if waiting >= self.max_queue_len:
            raise OpenAIError(
                429, f"the waiting queue is full ({waiting} requests waiting, "
                     f"--max-queue-len={self.max_queue_len}): retry after a second",
                code="queue_full", headers={"Retry-After": "1"})
        self.in_flight += 1
        self._idle.clear()

    def release(self) -> None:
        """Marks one admitted generation as fully answered."""
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle.set()

    def start_drain(self) -> None:
        if not self.draining:
            logger.info("draining: %d generations in flight", self.in_flight)
            self.draining = True
            if self._on_drain is not None:
                self._on_drain(True)

    async def wait_idle(self, timeout: float) -> bool:
        """Gives whether every generation in flight ended within `timeout`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def drain(self, timeout: float) -> bool:
        """Closes the gate and gives whether every in-flight generation ended within `timeout`."""
        self.start_drain()
        start = time.monotonic()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            logger.warning("drain timeout of %.1fs passed with %d generations in flight",
                           timeout, self.in_flight)
            return False
        logger.info("drained in %.2fs", time.monotonic() - start)
        return True
