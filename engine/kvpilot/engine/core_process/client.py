"""The API server's end of the engine core: add and abort requests, stream their outputs.

Everything runs on the server's event loop: handlers send `AddRequest` and wait
for the core's `AddResults` (a refusal raises the engine's ValueError, which
names the field); one task reads the core's messages and turns each step's
deltas into text (`RequestState`) for each request's reader. A reader that
falls behind gets what it missed merged into one delta. When the core process
ends (its pipe closes) or reports a failure, every open stream and waiting
add gets an `EngineDeadError` at once, and `dead` turns true.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from kvpilot.engine.contracts.outputs import EngineStats, RequestOutput
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.core.outputs import EngineCoreOutput
from kvpilot.engine.core_process.launch import CoreHandle
from kvpilot.engine.core_process.messages import (
    AbortRequests,
    AddRequest,
    AddResults,
    CoreFailed,
    Hello,
    KVEvents,
    KVEventsQuery,
    LoRAAdapterAnswer,
    LoRAAdapterQuery,
    StepOutputs,
    ToCore,
    from_core_decoder,
)
from kvpilot.engine.engine_loop.request_state import RequestState, merge_deltas

logger = logging.getLogger(__name__)
# one request's outputs (deltas when streaming, else the final one); closing it before the
# last aborts the request
OutputStream = AsyncGenerator[RequestOutput, None]
# after the core's pipe closes, how long a CoreFailed (the reason) may still take to arrive
EXIT_GRACE_S = 0.1


class RequestMetrics(Protocol):
    """What the client reports to the API server's metrics (`server.metrics.ServerMetrics`;
    the core process room sits below the server)."""

    def set_stats(self, stats: EngineStats) -> None:
        """Takes the engine's latest gauges and counters."""
        ...

    def on_added(self, request_id: str, arrival_time: float, num_prompt_tokens: int = 0) -> None:
        """Starts tracking a request the engine accepted."""
        ...

    def on_output(self, output: EngineCoreOutput, now: float | None = None) -> None:
        """Observes a request's delta (TTFT, ITL, finish)."""
        ...

    def on_aborted(self, request_id: str, now: float | None = None) -> None:
        """Counts a request the server aborted."""
        ...


class EngineDeadError(RuntimeError):
    """The engine core failed or exited; the server can no longer generate."""


class RequestAbortedError(RuntimeError):
    """The server aborted the request (drain timeout); the message says why."""


class _Outputs:
    """One request's outputs waiting for its reader."""

    def __init__(self) -> None:
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self._closed = False  # a finished output or an error was put: nothing follows

    def put(self, item: RequestOutput | BaseException) -> None:
        if self._closed:
            return
        current = self._item
        if isinstance(item, RequestOutput) and isinstance(current, RequestOutput):
            item = merge_deltas(current, item)  # only streams have more than one output
        self._closed = isinstance(item, BaseException) or item.finished
        self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self._ready.wait()
        self._ready.clear()
        item, self._item = self._item, None
        assert item is not None, "set only with an item"
        return item


@dataclass
class _Live:
    state: RequestState
    arrival_time: float
    outputs: _Outputs = field(default_factory=_Outputs)
    accepted: asyncio.Future[None] | None = None  # until the core's AddResults


class CoreClient:
    """Talks to one engine core over a ZeroMQ DEALER socket; one per API server process."""

    def __init__(self, core: CoreHandle, tokenizer: TokenizerLike,
                 metrics: RequestMetrics | None = None) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._requests: dict[str, _Live] = {}
        self._queries: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._lora_answers: dict[int, asyncio.Future[LoRAAdapterAnswer]] = {}
        self._query_ids = itertools.count()
        self._error: str | None = None
        self._stats = EngineStats()
        self._encode = msgspec.msgpack.Encoder().encode
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None

    # ---- life -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connects to the core and starts reading its messages (on the running loop)."""
        self._context = zmq.asyncio.Context()
        socket = self._socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, f"api-{uuid.uuid4().hex}".encode())
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.core.address)
        self._send(Hello())
        self._reader = asyncio.create_task(self._read_forever())
        asyncio.get_running_loop().add_reader(self.core.exits.fileno(), self._on_core_exit)

    async def close(self) -> None:
        """Stops reading and disconnects (the core keeps running)."""
        with contextlib.suppress(ValueError, OSError):  # the pipe may be closed already
            asyncio.get_running_loop().remove_reader(self.core.exits.fileno())
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._socket is not None:
            self._socket.close()
        if self._context is not None:
            self._context.term()

    @property
    def dead(self) -> bool:
        """Whether the core failed or exited (the server can no longer generate)."""
        return self._error is not None

    @property
    def stats(self) -> EngineStats:
        """The engine's stats as of the core's latest step."""
        return self._stats

    @property
    def num_pending(self) -> int:
        """Requests sent to the core that it has not taken yet."""
        return sum(1 for live in self._requests.values() if live.accepted is not None)

    # ---- requests ---------------------------------------------------------------------

    def has_request(self, request_id: str) -> bool:
        """Gives whether a request of this id is running (its id cannot be reused yet)."""
        return request_id in self._requests

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, arrival_time: float | None = None,
                          priority: int = 0, *, stream: bool,
                          lora_name: str | None = None) -> OutputStream:
        """Gives the request's outputs once the core took it: deltas when `stream`, else its
        final output. Raises the engine's ValueError (naming the field) when refused."""
        if self._error is not None:
            raise EngineDeadError(self._error)
        if request_id in self._requests:  # its stream would replace the running one's
            raise ValueError(f"request_id={request_id!r} is already running: use a unique id")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        accepted = asyncio.get_running_loop().create_future()
        state = RequestState(request_id, None, prompt_token_ids, params, self.tokenizer,
                             stream=stream)
        if params.resume_token_ids is not None:
            state.resume(params.resume_token_ids)
        live = self._requests[request_id] = _Live(state, arrival, accepted=accepted)
        self._send(AddRequest(request_id, prompt_token_ids, params, arrival, priority,
                              lora_name))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._requests.pop(request_id, None)
            raise
        return self._iterate(request_id, live)

    async def _iterate(self, request_id: str, live: _Live) -> OutputStream:
        finished = False
        try:
            while True:
                item = await live.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Asks the core to abort `request_id` (no-op when it already finished)."""
        if self._requests.pop(request_id, None) is None:
            return
        if self._error is None:
            self._send(AbortRequests([request_id]))
        if self.metrics is not None:
            self.metrics.on_aborted(request_id)

    def abort_all(self, reason: str, only: Collection[str] | None = None) -> int:
        """Aborts every request in flight (or those of them in `only`); each reader gets a
        RequestAbortedError(reason)."""
        if only is None:
            lives, self._requests = self._requests, {}
        else:
            lives = {rid: live for rid in only if (live := self._requests.pop(rid, None))}
        if lives and self._error is None:
            self._send(AbortRequests(list(lives)))
        for request_id, live in lives.items():
            self._fail(live, RequestAbortedError(reason))
            if self.metrics is not None:
                self.metrics.on_aborted(request_id)
        return len(lives)

    async def kv_events(self, since: int) -> dict[str, Any]:
        """Gives the prefix cache's events since `since` (`KVEventLog.read`), from the core."""
        if self._error is not None:
            raise EngineDeadError(self._error)
        query_id = next(self._query_ids)
        answer = self._queries[query_id] = asyncio.get_running_loop().create_future()
        # msgpack carries 64-bit ints; any `since` beyond the log's numbers means "resync"
        self._send(KVEventsQuery(query_id, max(-1, min(since, 2**63 - 1))))
        try:
            return await answer
        finally:
            self._queries.pop(query_id, None)

    async def lora_adapter(self, op: str, lora_name: str = "", lora_path: str = ""
                           ) -> LoRAAdapterAnswer:
        """Gives the core's answer to a LoRA adapter load, unload or list (`lora.runtime`)."""
        if self._error is not None:
            raise EngineDeadError(self._error)
        query_id = next(self._query_ids)
        answer = self._lora_answers[query_id] = asyncio.get_running_loop().create_future()
        self._send(LoRAAdapterQuery(query_id, op, lora_name, lora_path))
        try:
            return await answer
        finally:
            self._lora_answers.pop(query_id, None)

    # ---- the core's messages ----------------------------------------------------------

    def _send(self, message: ToCore) -> None:
        assert self._socket is not None, "start() connects the socket"
        self._socket.send(self._encode(message))  # never blocks: no high-water mark

    async def _read_forever(self) -> None:
        assert self._socket is not None, "start() connects the socket"
        decode = from_core_decoder().decode
        try:
            while True:
                message = decode(await self._socket.recv())
                if isinstance(message, StepOutputs):
                    self._on_step(message)
                elif isinstance(message, AddResults):
                    self._on_add_results(message)
                elif isinstance(message, LoRAAdapterAnswer):
                    if (lora := self._lora_answers.get(message.query_id)) and not lora.done():
                        lora.set_result(message)
                elif isinstance(message, KVEvents):
                    if (answer := self._queries.get(message.query_id)) and not answer.done():
                        answer.set_result(message.answer)
                elif isinstance(message, CoreFailed):
                    self._die(message.message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a message this server cannot read: stop generating
            logger.exception("reading the engine core's messages failed")
            self._die(f"engine failed: the API server could not read the core's message: {exc}")

    def _on_step(self, message: StepOutputs) -> None:
        self._stats = message.stats
        metrics = self.metrics
        if metrics is not None:
            metrics.set_stats(message.stats)
        requests = self._requests
        now = time.monotonic()  # the step's deltas arrived together
        for delta in message.outputs:
            rid = delta.request_id
            live = requests.pop(rid, None) if delta.finished else requests.get(rid)
            if live is None:
                continue  # aborted by this server meanwhile
            if metrics is not None:
                metrics.on_output(delta, now)
            output = live.state.apply(delta)
            if output is not None:
                live.outputs.put(output)

    def _on_add_results(self, message: AddResults) -> None:
        for request_id in message.accepted:
            live = self._requests.get(request_id)
            if live is not None and live.accepted is not None:
                accepted, live.accepted = live.accepted, None
                if not accepted.done():
                    accepted.set_result(None)
                # here, not where add_request resumes: this task may read the request's
                # first outputs before that
                if self.metrics is not None:
                    self.metrics.on_added(request_id, live.arrival_time,
                                          len(live.state.prompt_token_ids))
        for request_id, reason in message.rejected:
            live = self._requests.pop(request_id, None)
            if live is not None and live.accepted is not None and not live.accepted.done():
                live.accepted.set_exception(ValueError(reason))

    def _on_core_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.core.exits.fileno())
        loop.call_later(EXIT_GRACE_S, self._die, "engine failed: the engine core process exited")

    def _die(self, reason: str) -> None:
        """Fails every waiter with EngineDeadError(reason); the first reason stays."""
        if self._error is not None:
            return
        logger.error("%s: failing %d requests", reason, len(self._requests))
        self._error = reason
        lives, self._requests = self._requests, {}
        for live in lives.values():
            self._fail(live, EngineDeadError(reason))
        for answer in [*self._queries.values(), *self._lora_answers.values()]:
            if not answer.done():
                answer.set_exception(EngineDeadError(reason))

    @staticmethod
    def _fail(live: _Live, error: BaseException) -> None:
        if live.accepted is not None:
            if not live.accepted.done():
                live.accepted.set_exception(error)
        else:
            live.outputs.put(error)
