"""Stalled instances: open to TCP, silent to HTTP (a frozen process, SIGSTOP, a stuck loop).

The kernel keeps accepting connections for a stopped process, so no refused connection
and no 5xx ever says it failed; a request there would wait for `--idle-timeout` (60 s).
The router asks every instance something at least every refresh interval (its /metrics
scrape is the active health check) and notes when an answer's bytes arrive. An instance
counts as stalled when the router has been waiting for it (a request, or that health
check) and it has sent no byte for `--stall-timeout` seconds, while another instance did
within that time: a router starved of CPU, or a fleet all of whose members are slow,
ejects no one.

A stalled instance leaves rotation until it answers again (the next health check after a
SIGCONT), and every request on it that has sent nothing to its client yet is retried on
another instance (`until_stalled`). A stream already under way waits (the instance may
resume), up to `--idle-timeout`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Protocol, TypeVar

T = TypeVar("T")
W = TypeVar("W", bound="Watched")


class Watched(Protocol):
    """What the stall rule reads of an instance."""

    @property
    def ready(self) -> bool: ...

    @property
    def last_heard(self) -> float: ...

    @property
    def silent_since(self) -> float:
        """When it last answered, or the router began waiting for it, whichever is later."""
        ...

    @property
    def outstanding(self) -> bool: ...

    @property
    def stalled(self) -> bool: ...


class Stalled(Exception):
    """The instance was found stalled before it answered: retry elsewhere."""


def find_stalled(instances: Iterable[W], now: float, stall_timeout: float) -> list[W]:
    """Gives the instances that newly count as stalled at `now` (see the module's rule)."""
    members = [i for i in instances if i.ready]
    silent = [i for i in members if i.outstanding and not i.stalled
              and now - i.silent_since > stall_timeout]
    if not silent:
        return []
    others_answered = [i for i in members if now - i.last_heard <= stall_timeout]
    return silent if others_answered else []


async def until_stalled(stall: asyncio.Event, work: Awaitable[T]) -> T:
    """Gives `work`'s result; cancels it and raises Stalled if `stall` is set first."""
    task = asyncio.ensure_future(work)
    if not stall.is_set():
        waiter = asyncio.ensure_future(stall.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise Stalled("the instance stalled before it answered")
