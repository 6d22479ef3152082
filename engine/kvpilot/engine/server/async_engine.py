"""The engine thread and its asyncio bridge: handlers enqueue, one thread steps the engine.

`LLMEngine` is not thread-safe, so exactly one thread touches it. HTTP handlers
put adds and aborts on a locked inbox and wake the thread through a condition;
the thread sleeps on that condition when the engine is idle (no busy spin).
Each request's outputs go back to its handler's `asyncio.Queue` through
`loop.call_soon_threadsafe`, so no HTTP work stalls a step and no step blocks
a request's acceptance.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from kvpilot.engine.contracts.outputs import EngineStats, RequestOutput
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_core import EngineCore
from kvpilot.engine.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)
# Log each engine iteration longer than this many milliseconds, with where its time went
# (inbox, step, lock and GPU waits, delivery, garbage collection): what stretched an ITL.
SLOW_ITERATION_ENV = "KVPILOT_SLOW_STEP_MS"
# one request's cumulative outputs; closing it before the last aborts the request
OutputStream = AsyncGenerator[RequestOutput, None]


class _GcClock:
    """Sums the time Python's cyclic GC ran, in any thread (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._since = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._since = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._since

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)


class EngineDeadError(RuntimeError):
    """The engine thread failed; the server can no longer generate."""


class RequestAbortedError(RuntimeError):
    """The server aborted the request (drain timeout); the message says why."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    priority: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    accepted: asyncio.Future[None]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


@dataclass
class _Inbox:
    adds: list[_Add] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


def _put(stream: _Stream, item: RequestOutput | BaseException) -> None:
    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _put_all(batch: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, output in batch:
        stream.queue.put_nowait(output)


def _resolve(add: _Add, error: BaseException | None) -> None:
    def settle() -> None:
        if add.accepted.done():
            return
        if isinstance(error, asyncio.CancelledError):
            add.accepted.cancel()
        elif error is None:
            add.accepted.set_result(None)
        else:
            add.accepted.set_exception(error)
    add.loop.call_soon_threadsafe(settle)


class AsyncEngine:
    """Runs an engine on its own thread and streams its outputs to asyncio callers."""

    def __init__(self, engine: EngineCore, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._cond = threading.Condition()
        self._inbox = _Inbox()
        self._streams: dict[str, _Stream] = {}  # guarded by _cond
        self._stopping = False
        self._error: BaseException | None = None
        self._stats = EngineStats()
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)

    # ---- asyncio side -------------------------------------------------------------

    def start(self) -> None:
        self._publish_stats()
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the engine thread after its current step."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def fail(self, reason: str) -> None:
        """Marks the engine failed, from any thread (a tensor-parallel worker died between
        steps): /health and /ready answer 503, every waiter gets the error, new requests
        are refused, and the engine thread stops."""
        error = EngineDeadError(f"engine failed: {reason}")
        if self._error is None:
            self._error = error
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._fail_all(error)

    @property
    def dead(self) -> bool:
        """Whether the engine thread failed (the server can no longer generate)."""
        return self._error is not None

    @property
    def stats(self) -> EngineStats:
        """The latest stats snapshot (published by the engine thread after each step)."""
        return self._stats

    @property
    def num_pending(self) -> int:
        """Requests enqueued but not yet handed to the engine."""
        with self._cond:
            return len(self._inbox.adds)

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams, arrival_time: float | None = None,
                          priority: int = 0) -> OutputStream:
        """Gives the request's output stream once the engine accepted it.

        Raises the engine's ValueError (naming the field) when it refuses the request.
        """
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error}")
        loop = asyncio.get_running_loop()
        add = _Add(request_id, prompt, params,
                   time.monotonic() if arrival_time is None else arrival_time, priority,
                   loop, asyncio.Queue(), loop.create_future())
        with self._cond:
            self._inbox.adds.append(add)
            self._cond.notify()
        try:
            await add.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return self._iterate(request_id, add.queue)

    async def _iterate(self, request_id: str,
                       queue: asyncio.Queue[RequestOutput | BaseException]
                       ) -> OutputStream:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                # Coalesce: a slow reader skips to the newest cumulative output.
                while not item.finished and not queue.empty():
                    newer = queue.get_nowait()
                    if isinstance(newer, BaseException):
                        raise newer
                    item = newer
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Asks the engine thread to abort `request_id` (no-op when already finished)."""
        with self._cond:
            if request_id in self._streams or any(a.request_id == request_id
                                                  for a in self._inbox.adds):
                self._inbox.aborts.append(request_id)
                self._cond.notify()

    def abort_all(self, reason: str) -> int:
        """Aborts every request in flight; each waiter gets a RequestAbortedError(reason)."""
        with self._cond:
            streams = list(self._streams.values())
            ids = list(self._streams) + [a.request_id for a in self._inbox.adds]
            self._inbox.aborts.extend(ids)
            self._cond.notify()
        for stream in streams:
            _put(stream, RequestAbortedError(reason))
        return len(ids)

    # ---- engine thread ------------------------------------------------------------

    def _run(self) -> None:
        slow_ms = float(os.environ.get(SLOW_ITERATION_ENV) or 0)
        gc_clock = _GcClock() if slow_ms > 0 else None
        try:
            while True:
                with self._cond:
                    while (not self._stopping and not self._inbox.adds
                           and not self._inbox.aborts and not self._has_work()):
                        self._cond.wait()
                    if self._stopping:
                        return
                    inbox, self._inbox = self._inbox, _Inbox()
                start = time.perf_counter()
                gc_before = gc_clock.seconds if gc_clock else 0.0
                self._apply(inbox)
                applied = stepped = time.perf_counter()
                if self._has_work():
                    outputs = self.engine.step()
                    stepped = time.perf_counter()
                    self._deliver(outputs)
                self._publish_stats()
                if gc_clock and (done := time.perf_counter()) - start > slow_ms / 1000:
                    logger.warning(
                        "slow engine iteration: %.1f ms (inbox %.1f ms, %d adds; step %.1f ms: "
                        "%s; deliver %.1f ms; GC %.1f ms)", (done - start) * 1e3,
                        (applied - start) * 1e3, len(inbox.adds), (stepped - applied) * 1e3,
                        self.engine.step_timing(), (done - stepped) * 1e3,
                        (gc_clock.seconds - gc_before) * 1e3)
        except BaseException as exc:  # the engine is broken: fail every waiter
            logger.exception("engine thread failed")
            self._error = exc
            self._fail_all(EngineDeadError(f"engine failed: {type(exc).__name__}: {exc}"))
        finally:
            if gc_clock:
                gc_clock.close()

    def _has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _apply(self, inbox: _Inbox) -> None:
        aborted = set(inbox.aborts)
        for add in inbox.adds:
            if add.request_id in aborted:
                _resolve(add, asyncio.CancelledError())
                continue
            try:
                self.engine.add_request(add.request_id, add.prompt, add.params,
                                        arrival_time=add.arrival_time, priority=add.priority)
            except ValueError as exc:
                _resolve(add, exc)
                continue
            with self._cond:
                self._streams[add.request_id] = _Stream(add.loop, add.queue)
            if self.metrics is not None:
                self.metrics.on_added(add.request_id, add.arrival_time)
            _resolve(add, None)
        live = [rid for rid in inbox.aborts if rid in self._streams]
        if live:
            self.engine.abort_request(live)
            with self._cond:
                for rid in live:
                    self._streams.pop(rid, None)
            if self.metrics is not None:
                for rid in live:
                    self.metrics.on_aborted(rid)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One wake-up of each event loop per step, not one per output.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for output in outputs:
            if self.metrics is not None:
                self.metrics.on_output(output)
            with self._cond:
                stream = (self._streams.pop(output.request_id, None) if output.finished
                          else self._streams.get(output.request_id))
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, output))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _publish_stats(self) -> None:
        stats = self.engine.get_stats()
        self._stats = stats
        if self.metrics is not None:
            self.metrics.set_stats(stats)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            streams, self._streams = self._streams, {}
            adds, self._inbox = self._inbox.adds, _Inbox()
        for stream in streams.values():
            _put(stream, error)
        for add in adds:
            _resolve(add, error)
