"""`kvpilot serve`: start the engine core process, then serve the OpenAI API in front of it.

This process binds the port and starts the engine core process (scheduler, KV
cache, model runner, sampler; `kvpilot.engine.core_process`), which loads the
model. Then it serves HTTP itself (and tokenises, detokenises, streams), or with
`--api-server-count N` starts N API server processes on the shared socket
(`api_servers`). When they have drained and exited, it stops the core. Nothing
here imports torch: the core process does.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from kvpilot.engine.contracts.args import EngineArgs, ServerArgs, add_dataclass_args, from_namespace

# Printed once the engine is ready and the socket bound; tests and `kvpilot up` read the
# port from it.
READY_LINE = "kvpilot serve: listening on http://{host}:{port}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
    from kvpilot.engine.core_process.launch import CoreProcess, CoreStartError
    from kvpilot.engine.server.api_servers import LOG_FORMAT, run_api_servers, serve_api

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format=LOG_FORMAT)
    try:
        engine_args = from_namespace(EngineArgs, args)
        server_args = from_namespace(ServerArgs, args)
    except ValueError as exc:
        print(f"kvpilot serve: {exc}", file=sys.stderr)
        return 2
    sock = bind(server_args.host, server_args.port)
    host, port = sock.getsockname()[:2]
    # the KV agent of a prefill/decode role listens beside this port, in the core process
    core = CoreProcess.start(engine_args, host, port, server_args.log_level)
    try:
        try:
            handle = core.wait_ready()
        except CoreStartError as exc:
            print(f"kvpilot serve: {exc}", file=sys.stderr)
            return 1
        print(READY_LINE.format(host=host, port=port), file=sys.stderr, flush=True)
        if server_args.api_server_count > 1:
            return run_api_servers(handle, engine_args, server_args, sock)
        serve_api(handle, engine_args, server_args, sock)
        return 0
    finally:
        core.stop()
        sock.close()
