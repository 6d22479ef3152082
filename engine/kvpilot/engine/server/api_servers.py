"""The API server processes of `kvpilot serve`: uvicorn serving the app, draining on SIGTERM.

With `--api-server-count 1` (the default) `kvpilot serve`'s own process is the
API server. With N > 1 it starts N processes (`spawn`) that accept on its one
listening socket (the kernel hands each connection to one of them), each with
its own connection to the engine core, and waits for them.

uvicorn's own signal handling would stop accepting and then cut open streams
after its graceful timeout; an API server takes SIGTERM/SIGINT itself: the
first one starts a drain (`/ready` 503, new requests refused, in-flight ones
finish within `--drain-timeout`), then uvicorn is asked to exit and the process
returns 0. A second SIGINT (Ctrl+C) exits at once; a repeated SIGTERM is
ignored. The launcher of N processes forwards SIGTERM/SIGINT to each. From the
"listening on" line on, a signal that comes before a process serves (it may still be
importing its app) is held, and the drain starts as soon as it serves.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

from kvpilot.engine.contracts.args import EngineArgs, ServerArgs
from kvpilot.engine.contracts.http_auth import HttpAuth
from kvpilot.engine.contracts.streaming_gc import settle_gc
from kvpilot.engine.core_process.launch import CoreHandle
from kvpilot.engine.entrypoints.event_loop import run_event_loop

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

logger = logging.getLogger("kvpilot.serve")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_early_signals: list[int] = []  # got by `hold_signals` before the server could drain


def hold_signals() -> None:
    """Has SIGTERM/SIGINT recorded from now on instead of ending the process: once serving
    (or, for the launcher of N servers, once they are started) it drains at once."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _: _early_signals.append(signum))


@dataclass(frozen=True)
class ApiServerConfig:
    """What every API server process serves with (passed to each at spawn)."""

    engine_args: EngineArgs
    server_args: ServerArgs
    auth: HttpAuth  # the API key and fleet secret each path needs
    chat_template: str | None = None  # --chat-template's text, replacing the model's


def make_server(app: FastAPI, server_args: ServerArgs) -> uvicorn.Server:
    """Gives a uvicorn server whose SIGTERM/SIGINT start a drain instead of a hard stop."""
    import asyncio
    import contextlib
    import threading

    import uvicorn

    from kvpilot.engine.server.drain import HANDOVER_MESSAGE

    class DrainingServer(uvicorn.Server):
        drain_task: asyncio.Task[None] | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield  # signals reach only the main thread; in-process tests drain by hand
                return
            loop = asyncio.get_running_loop()
            for sig in STOP_SIGNALS:
                loop.add_signal_handler(sig, self.on_signal, sig)
            for sig in _early_signals:  # drains at once: nothing was served yet
                self.on_signal(sig)
            try:
                yield
            finally:
                for sig in STOP_SIGNALS:
                    loop.remove_signal_handler(sig)

        def on_signal(self, sig: int) -> None:
            if self.drain_task is not None:
                # Wrappers (timeout, some inits) may repeat SIGTERM: only a second
                # Ctrl+C means "stop now".
                if sig == signal.SIGINT:
                    logger.warning("second SIGINT: exiting without waiting")
                    self.should_exit = self.force_exit = True
                else:
                    logger.info("signal %s again: already draining", sig)
                return
            logger.info("signal %s: draining for up to %.1fs", sig, server_args.drain_timeout)
            self.drain_task = asyncio.ensure_future(self.drain_then_exit())

        async def drain_then_exit(self) -> None:
            ctx = app.state.ctx
            handover = min(server_args.drain_handover_timeout, server_args.drain_timeout)
            ctx.gate.start_drain()
            if not await ctx.gate.wait_idle(handover) and ctx.resumable:
                # a router resumes these elsewhere (`stream_resume`): no need to wait for them
                moved = ctx.engine.abort_all(HANDOVER_MESSAGE, only=list(ctx.resumable))
                logger.info("drain: handed %d streams over after %.1fs", moved, handover)
            if not await ctx.gate.drain(server_args.drain_timeout - handover):
                aborted = ctx.engine.abort_all(
                    f"the server drained for --drain-timeout={server_args.drain_timeout}s "
                    "and aborted this request: retry on another replica")
                logger.warning("drain timed out: aborted %d requests", aborted)
                await ctx.gate.drain(5.0)  # let the aborted streams send their last event
            self.should_exit = True

    config = uvicorn.Config(app, log_level=server_args.log_level, timeout_graceful_shutdown=5,
                            access_log=server_args.log_level == "debug")
    return DrainingServer(config)


def serve_api(core: CoreHandle, config: ApiServerConfig, sock: socket.socket) -> None:
    """Serves the OpenAI API for `core` on `sock` until a signal drained it."""
    from kvpilot.engine.contracts.tokenizer import Tokenizer, load_tokenizer
    from kvpilot.engine.server.app import build_app

    engine_args, server_args = config.engine_args, config.server_args
    tokenizer = load_tokenizer(engine_args.tokenizer or engine_args.model)
    # chats are rendered here, in the API server: its tokenizer carries the template
    if config.chat_template is not None and isinstance(tokenizer, Tokenizer):
        tokenizer.chat_template = config.chat_template
    app = build_app(core, tokenizer, engine_args.name, max_queue_len=server_args.max_queue_len,
                    auth=config.auth, tool_call_parser=server_args.tool_call_parser
                    if server_args.enable_auto_tool_choice else None,
                    max_request_bytes=server_args.max_request_bytes,
                    max_prompt_chars=server_args.max_prompt_chars)
    sizes = app.state.request_limits
    logger.info("requests: bodies up to %d bytes (--max-request-bytes), prompts up to %d "
                "characters (--max-prompt-chars)", sizes.max_request_bytes,
                sizes.max_prompt_chars)
    settle_gc()
    run_event_loop(make_server(app, server_args).serve(sockets=[sock]))


def _api_server_process(core: CoreHandle, config: ApiServerConfig, sock: socket.socket) -> None:
    # Started with the stop signals blocked (see run_api_servers): one the launcher forwarded
    # while this process was importing its app (seconds on a busy node) waits for the drain.
    hold_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    logging.basicConfig(level=config.server_args.log_level.upper(), stream=sys.stderr,
                        format=LOG_FORMAT)
    launcher = multiprocessing.parent_process()
    if launcher is not None:  # a killed launcher must not leave this process on the port
        threading.Thread(target=_drain_when_gone, args=(launcher.sentinel,), daemon=True,
                         name="kvpilot-launcher-watch").start()
    serve_api(core, config, sock)


def _drain_when_gone(sentinel: int) -> None:
    """Sends this process SIGTERM (a drain, then exit) once the launcher process is gone."""
    multiprocessing.connection.wait([sentinel])
    os.kill(os.getpid(), signal.SIGTERM)


def run_api_servers(core: CoreHandle, config: ApiServerConfig, sock: socket.socket) -> int:
    """Runs `--api-server-count` API server processes on `sock` until they exit; gives the exit
    code (1 when one of them died on its own: the others are stopped, so the pod restarts)."""
    from kvpilot.engine.server.metrics import MULTIPROC_DIR_ENV

    metrics_dir = tempfile.mkdtemp(prefix="kvpilot-metrics-")
    os.environ[MULTIPROC_DIR_ENV] = metrics_dir  # read by the children's prometheus_client
    context = multiprocessing.get_context("spawn")
    servers = [context.Process(target=_api_server_process, name=f"kvpilot-api-server-{i}",
                               args=(core, config, sock))
               for i in range(config.server_args.api_server_count)]
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for server in servers:
            if server.is_alive() and server.pid is not None:
                os.kill(server.pid, signal.SIGTERM)  # each drains its own streams

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        # each server starts with the stop signals blocked: pending until it holds them
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            for server in servers:
                server.start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        for sig in _early_signals:  # got after the listening line, before `stop` was set
            stop(sig, None)
        while running := [s for s in servers if s.exitcode is None]:
            multiprocessing.connection.wait([s.sentinel for s in running])
            if not stopping and any(s.exitcode not in (None, 0) for s in servers):
                logger.error("an API server process exited (codes %s): stopping the others",
                             [s.exitcode for s in servers])
                stop(signal.SIGTERM, None)
        return 0 if all(s.exitcode == 0 for s in servers) else 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(metrics_dir, ignore_errors=True)
