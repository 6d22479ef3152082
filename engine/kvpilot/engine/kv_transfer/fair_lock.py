"""A reentrant lock granted in arrival order, shared by the engine thread and the KV agent.

The engine thread takes the store's lock for every step and retakes it microseconds
after releasing it. With `threading.RLock` a waiting KV agent is woken by the
release but the engine thread, still holding the GIL, gets the lock back first,
step after step: on a busy engine a pull waited seconds per chunk (measured: long
prompts' transfers timed out and fell back to local prefill). Here a thread that
finds others queued waits its turn, so the agent waits at most one step.
"""

from __future__ import annotations

import collections
import threading


class FairLock:
    """Reentrant; among threads waiting for it, the one that asked first gets it next."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._queue: collections.deque[int] = collections.deque()

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is not None or self._queue:
                self._queue.append(me)
                while self._owner is not None or self._queue[0] != me:
                    self._cond.wait()
                self._queue.popleft()
            self._owner, self._depth = me, 1
            return True

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("release of a FairLock this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
