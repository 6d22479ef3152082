"""`kvpilot serve`: load the engine, serve the OpenAI API with uvicorn, drain on SIGTERM.

uvicorn's own signal handling would stop accepting and then cut open streams
after its graceful timeout; we take SIGTERM/SIGINT ourselves: the first one
starts a drain (`/ready` 503, new requests refused, in-flight ones finish
within `--drain-timeout`), then uvicorn is asked to exit and the process
returns 0. A second SIGINT (Ctrl+C) exits at once; a repeated SIGTERM is ignored.

With a world size above one the engine starts its worker processes itself; on the
other pods of a multi-node group (NODE_RANK > 0) this command runs those pods'
workers only (`parallel/worker_pod.py`). A topology the engine refuses exits 2 with
the reason before anything loads.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvpilot.engine.contracts.args import (
    EngineArgs,
    ServerArgs,
    add_dataclass_args,
    from_namespace,
    model_from_cli,
    resolve_api_key,
)
from kvpilot.engine.contracts.fleet_secret import UNAUTHENTICATED_WARNING, FleetSecret
from kvpilot.engine.contracts.http_auth import HttpAuth

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

logger = logging.getLogger("kvpilot.serve")

# Printed once the socket is bound; tests and `kvpilot up` read the port from it.
READY_LINE = "kvpilot serve: listening on http://{host}:{port}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve, as with vLLM (or --model): a directory, a Hub "
                             "id in the local Hugging Face cache, or tiny-llama")
    engine = parser.add_argument_group("engine")
    add_dataclass_args(engine, EngineArgs)
    server = parser.add_argument_group("server")
    add_dataclass_args(server, ServerArgs)


def bind(host: str, port: int) -> socket.socket:
    """Gives a listening socket on (host, port); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_server(app: FastAPI, server_args: ServerArgs) -> uvicorn.Server:
    """Gives a uvicorn server whose SIGTERM/SIGINT start a drain instead of a hard stop."""
    import asyncio
    import contextlib
    import threading

    import uvicorn

    class DrainingServer(uvicorn.Server):
        drain_task: asyncio.Task[None] | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield  # signals reach only the main thread; in-process tests drain by hand
                return
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.on_signal, sig)
            try:
                yield
            finally:
                for sig in (signal.SIGTERM, signal.SIGINT):
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
            if not await ctx.gate.drain(server_args.drain_timeout):
                aborted = ctx.engine.abort_all(
                    f"the server drained for --drain-timeout={server_args.drain_timeout}s "
                    "and aborted this request: retry on another replica")
                logger.warning("drain timed out: aborted %d requests", aborted)
                await ctx.gate.drain(5.0)  # let the aborted streams send their last event
            self.should_exit = True

    config = uvicorn.Config(app, log_level=server_args.log_level, timeout_graceful_shutdown=5,
                            access_log=server_args.log_level == "debug")
    return DrainingServer(config)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from kvpilot.engine.contracts.rendezvous import Rendezvous
    from kvpilot.engine.contracts.tokenizer import Tokenizer, read_chat_template
    from kvpilot.engine.engine_core import ServedEngine
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.models.hub_cache import with_local_model
    from kvpilot.engine.server.app import build_app

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.model = model_from_cli(args.model_tag, args.model, "serve")
        engine_args = from_namespace(EngineArgs, args)
        server_args = from_namespace(ServerArgs, args)
        template = read_chat_template(server_args.chat_template) \
            if server_args.chat_template else None
        fleet = FleetSecret.from_file(engine_args.fleet_secret_file)
        rendezvous = Rendezvous.from_env(os.environ, engine_args.tensor_parallel_size
                                         * engine_args.pipeline_parallel_size)
        # every pod of a group loads the same snapshot of a Hub id (never a download)
        engine_args = with_local_model(engine_args)
    except ValueError as exc:
        print(f"kvpilot serve: {exc}", file=sys.stderr)
        return 2
    if rendezvous is not None and not rendezvous.is_driver_node:
        from kvpilot.engine.parallel.worker_pod import serve_worker_pod
        return serve_worker_pod(engine_args, server_args, rendezvous)
    if not fleet.enabled:
        logger.warning(UNAUTHENTICATED_WARNING)
    auth = HttpAuth(resolve_api_key(server_args.api_key), fleet,
                    server_args.metrics_require_api_key)
    try:
        llm_engine = LLMEngine.from_engine_args(engine_args)
    except ValueError as exc:  # a refused topology, a model that is not there or does not load
        print(f"kvpilot serve: {exc}", file=sys.stderr)
        return 2
    if template is not None and isinstance(llm_engine.tokenizer, Tokenizer):  # always, from files
        llm_engine.tokenizer.chat_template = template
    sock = bind(server_args.host, server_args.port)
    host, port = sock.getsockname()[:2]
    engine: ServedEngine = llm_engine
    if engine_args.role != "both":  # prefill/decode: a KV agent beside the engine
        from kvpilot.engine.roles import attach_role
        engine = attach_role(llm_engine, host, port)
    app = build_app(engine, engine_args.name, max_queue_len=server_args.max_queue_len, auth=auth)
    # a worker process that dies between steps takes the server down at once (503s)
    llm_engine.runner.on_failure(app.state.ctx.engine.fail)
    print(READY_LINE.format(host=host, port=port), file=sys.stderr, flush=True)
    asyncio.run(make_server(app, server_args).serve(sockets=[sock]))
    return 0
