"""The engine core process's loop: it steps the engine without waiting on any API server.

Each iteration takes every message waiting on the core's ROUTER socket (adds,
aborts, queries, from any number of API servers), answers the adds at once,
runs one engine step when there is work, and sends each API server one
`StepOutputs` with its own requests' deltas and the engine's stats. With no
work it sleeps in `poll` until a message arrives or the parent process exits:
no busy spin. One thread does all of it, so the engine (not thread-safe) is
only ever touched here; ZeroMQ's own I/O thread moves the bytes.

An engine that raises, or reports a failure between steps (`on_failure`: a
tensor-parallel worker died while the engine was idle), ends the loop the same
way: every API server gets `CoreFailed` with the reason, and the process exits.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import threading
import time

import msgspec
import zmq

from kvpilot.engine.contracts.outputs import EngineStats
from kvpilot.engine.core.outputs import EngineCoreOutput
from kvpilot.engine.core_process.lora_queries import lora_adapter_answer
from kvpilot.engine.core_process.messages import (
    AbortRequests,
    AddRequest,
    AddResults,
    CoreFailed,
    FromCore,
    Hello,
    KVEvents,
    KVEventsQuery,
    LoRAAdapterQuery,
    StepOutputs,
    to_core_decoder,
)
from kvpilot.engine.engine_loop.engine_core import ServedEngine

logger = logging.getLogger(__name__)
# Log each core iteration longer than this many milliseconds, with where its time went
# (inbox, step, lock and GPU waits, delivery, garbage collection): what stretched an ITL.
SLOW_ITERATION_ENV = "KVPILOT_SLOW_STEP_MS"


class _GcClock:
    """Sums the time Python's cyclic GC ran, in any thread (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._since = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._since = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._since

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)


class EngineBrokenError(RuntimeError):
    """The engine reported a failure between steps; the message is its reason."""


class EngineCoreProc:
    """Serves one engine to the API servers connected to `socket` (a bound ROUTER)."""

    def __init__(self, engine: ServedEngine, socket: zmq.Socket[bytes],
                 parent_sentinel: int | None = None) -> None:
        self.engine = engine
        self.socket = socket
        self.parent_sentinel = parent_sentinel  # readable once the parent process is gone
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder = to_core_decoder()
        self._clients: list[bytes] = []  # API servers' socket identities, in Hello order
        self._owners: dict[str, bytes] = {}  # live request id -> the API server that sent it
        self._sent_stats: EngineStats | None = None
        # the engine's failure between steps, set from its thread; the pipe wakes `poll`, as
        # does any signal (see `run`)
        self._failure: str | None = None
        self._failure_lock = threading.Lock()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)  # as signal.set_wakeup_fd needs
        engine.on_failure(self.fail)

    def fail(self, reason: str) -> None:
        """Stops serving with `reason` (from any thread): the loop sends `CoreFailed` and
        raises EngineBrokenError."""
        with self._failure_lock:
            if self._failure is not None or self._wake_write < 0:
                return
            self._failure = reason
            with contextlib.suppress(BlockingIOError):  # full: poll wakes all the same
                os.write(self._wake_write, b"!")

    def run(self) -> None:
        """Serves until the parent process exits; on an engine error, tells every API server
        (`CoreFailed`) and raises it."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        if self.parent_sentinel is not None:
            poller.register(self.parent_sentinel, zmq.POLLIN)
        # Linux may deliver a SIGTERM to any thread (gloo's, torch's): the main thread, asleep
        # in `poll`, runs the handler only once the signal's byte in the wake pipe wakes it
        # (seen: a tensor-parallel core SIGKILLed 10 s after its SIGTERM)
        on_main = threading.current_thread() is threading.main_thread()
        previous = signal.set_wakeup_fd(self._wake_write, warn_on_full_buffer=False) \
            if on_main else -1
        try:
            self._loop(poller)
        finally:
            if on_main:
                signal.set_wakeup_fd(previous)
            with self._failure_lock:
                os.close(self._wake_read)
                os.close(self._wake_write)
                self._wake_write = -1

    def _loop(self, poller: zmq.Poller) -> None:
        slow_ms = float(os.environ.get(SLOW_ITERATION_ENV) or 0)
        gc_clock = _GcClock() if slow_ms > 0 else None
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                ready = dict(poller.poll(0 if busy else None))
                if self._wake_read in ready:  # a failure's or a signal's byte (its handler ran)
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_read, 4096)
                if self.parent_sentinel is not None and self.parent_sentinel in ready:
                    logger.warning("the parent process is gone: the engine core stops")
                    return
                if self._failure is not None:
                    raise EngineBrokenError(self._failure)
                start = time.perf_counter()
                gc_before = gc_clock.seconds if gc_clock else 0.0
                adds = self._receive() if self.socket in ready else 0
                applied = stepped = time.perf_counter()
                outputs: list[EngineCoreOutput] = []
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    stepped = time.perf_counter()
                self._deliver(outputs)
                if gc_clock and (done := time.perf_counter()) - start > slow_ms / 1000:
                    logger.warning(
                        "slow engine iteration: %.1f ms (inbox %.1f ms, %d adds; step %.1f ms: "
                        "%s; deliver %.1f ms; GC %.1f ms)", (done - start) * 1e3,
                        (applied - start) * 1e3, adds, (stepped - applied) * 1e3,
                        self.engine.step_timing(), (done - stepped) * 1e3,
                        (gc_clock.seconds - gc_before) * 1e3)
        except Exception as exc:
            logger.exception("the engine failed")
            reason = str(exc) if isinstance(exc, EngineBrokenError) \
                else f"{type(exc).__name__}: {exc}"
            for client in self._clients:
                self._send(client, CoreFailed(f"engine failed: {reason}"))
            raise
        finally:
            if gc_clock:
                gc_clock.close()

    def _send(self, client: bytes, message: FromCore) -> None:
        self.socket.send_multipart([client, self._encode(message)])

    def _receive(self) -> int:
        """Applies every waiting message in arrival order; answers the adds; gives their count."""
        results: dict[bytes, AddResults] = {}
        while True:
            try:
                client, payload = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            message = self._decoder.decode(payload)
            if isinstance(message, AddRequest):
                answer = results.setdefault(client, AddResults([], []))
                try:
                    self.engine.add_request(message.request_id, message.prompt_token_ids,
                                            message.params, message.arrival_time,
                                            message.priority, message.lora_name)
                except ValueError as exc:
                    answer.rejected.append((message.request_id, str(exc)))
                    continue
                answer.accepted.append(message.request_id)
                self._owners[message.request_id] = client
            elif isinstance(message, AbortRequests):
                self.engine.abort_request(message.request_ids)
            elif isinstance(message, LoRAAdapterQuery):
                self._send(client, lora_adapter_answer(self.engine, message))
            elif isinstance(message, KVEventsQuery):
                self._send(client, KVEvents(message.query_id,
                                            self.engine.kv_events.read(message.since)))
            elif isinstance(message, Hello) and client not in self._clients:
                self._clients.append(client)
                self._sent_stats = None  # the newcomer gets the stats at the end of this round
        for client, answer in results.items():
            self._send(client, answer)
        return sum(len(a.accepted) + len(a.rejected) for a in results.values())

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        """Sends each API server its requests' deltas, with the stats when they changed."""
        by_client: dict[bytes, list[EngineCoreOutput]] = {}
        owners = self._owners
        for output in outputs:
            rid = output.request_id
            client = owners.pop(rid, None) if output.finished else owners.get(rid)
            if client is not None:
                by_client.setdefault(client, []).append(output)
        stats = self.engine.get_stats()
        changed = stats != self._sent_stats
        self._sent_stats = stats
        for client in self._clients:
            mine = by_client.get(client)
            if mine or changed:
                self._send(client, StepOutputs(mine or [], stats))
