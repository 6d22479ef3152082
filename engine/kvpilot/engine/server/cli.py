"""`kvpilot serve`: start the engine core process, then serve the OpenAI API in front of it.

This process binds the port and starts the engine core process (scheduler, KV
cache, model runner, sampler; `kvpilot.engine.core_process`), which loads the
model and logs each start-up phase. Then it serves HTTP itself (and tokenises,
detokenises, streams), or with `--api-server-count N` starts N API server
processes on the shared socket (`api_servers`). When they have drained and
exited, it stops the core. Nothing here imports torch: the core process does.

With a world size above one the core starts its worker processes itself; on the
other pods of a multi-node group (NODE_RANK > 0) this command runs those pods'
workers only (`executor/worker_pod.py`). A topology or model the engine refuses
exits 2 with the reason.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from kvpilot.engine.contracts.args import (
    EngineArgs,
    ServerArgs,
    add_dataclass_args,
    from_namespace,
    model_from_cli,
    resolve_api_key,
)
from kvpilot.engine.contracts.fleet_secret import (
    INSECURE_ROLE_REFUSAL,
    UNAUTHENTICATED_WARNING,
    FleetSecret,
)
from kvpilot.engine.contracts.http_auth import HttpAuth

logger = logging.getLogger("kvpilot.serve")

# Printed once the engine is ready and the socket bound; tests and `kvpilot up` read the
# port from it.
READY_LINE = "kvpilot serve: listening on http://{host}:{port}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve, as with vLLM (or --model): a directory, a Hub "
                             "id in the local Hugging Face cache, or tiny-llama")
    engine = parser.add_argument_group("engine")
    add_dataclass_args(engine, EngineArgs)
    server = parser.add_argument_group("server")
    add_dataclass_args(server, ServerArgs)


def listen_error(host: str, port: int, exc: OSError) -> str:
    """Gives the one-line reason a server cannot listen on (host, port), with the fix."""
    return (f"cannot listen on {host}:{port} ({exc.strerror or exc}): pick another --port "
            "(0: any free one) or stop the process that holds it")


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
    import os

    from kvpilot.engine.contracts.rendezvous import Rendezvous
    from kvpilot.engine.contracts.tokenizer import read_chat_template
    from kvpilot.engine.core_process.launch import CoreProcess, CoreStartError
    from kvpilot.engine.models.hub_cache import with_local_model
    from kvpilot.engine.server.api_servers import (
        LOG_FORMAT,
        ApiServerConfig,
        hold_signals,
        run_api_servers,
        serve_api,
    )

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format=LOG_FORMAT)
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
    except (ValueError, OSError) as exc:  # OSError: a file named by a flag that cannot be read
        print(f"kvpilot serve: {exc}", file=sys.stderr)
        return 2
    if rendezvous is not None and not rendezvous.is_driver_node:
        from kvpilot.engine.executor.worker_pod import serve_worker_pod
        return serve_worker_pod(engine_args, server_args, rendezvous)
    if not fleet.enabled and engine_args.role != "both" and not engine_args.insecure_kv:
        print(f"kvpilot serve: {INSECURE_ROLE_REFUSAL.format(role=engine_args.role)}",
              file=sys.stderr)
        return 2
    if not fleet.enabled and engine_args.insecure_kv:
        logger.warning(UNAUTHENTICATED_WARNING)
    config = ApiServerConfig(engine_args, server_args,
                             HttpAuth(resolve_api_key(server_args.api_key), fleet,
                                      server_args.metrics_require_api_key,
                                      open_fleet_paths=engine_args.insecure_kv), template)
    try:
        sock = bind(server_args.host, server_args.port)
    except OSError as exc:  # the port is taken, or the host is not this machine's
        print(f"kvpilot serve: {listen_error(server_args.host, server_args.port, exc)}",
              file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    # the KV agent of a prefill/decode role listens beside this port, in the core process
    core = CoreProcess.start(engine_args, host, port, server_args.log_level)
    try:
        try:
            handle = core.wait_ready()
        except CoreStartError as exc:
            # a refused topology or a model that does not load: 2; a crash: 1
            print(f"kvpilot serve: {exc}", file=sys.stderr)
            return 2 if exc.refused else 1
        hold_signals()  # a SIGTERM from now on drains (at once) instead of killing
        print(READY_LINE.format(host=host, port=port), file=sys.stderr, flush=True)
        if server_args.api_server_count > 1:
            return run_api_servers(handle, config, sock)
        serve_api(handle, config, sock)
        return 0
    finally:
        core.stop()
        sock.close()
