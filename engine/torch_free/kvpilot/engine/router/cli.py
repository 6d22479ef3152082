"""The `kvpilot route` subcommand: run the router in front of engine instances."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from kvpilot.engine.contracts.args import add_dataclass_args, from_namespace, resolve_api_key
from kvpilot.engine.contracts.fleet_secret import UNAUTHENTICATED_WARNING, FleetSecret
from kvpilot.engine.contracts.router_args import RouterArgs
from kvpilot.engine.contracts.streaming_gc import settle_gc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per RouterArgs field."""
    add_dataclass_args(parser, RouterArgs)


def run(args: argparse.Namespace) -> int:
    """Serves the router until SIGINT/SIGTERM; gives the exit code."""
    import uvicorn

    from kvpilot.engine.router.app import build_app

    try:
        router_args: RouterArgs = from_namespace(RouterArgs, args)
        router_args.api_key = resolve_api_key(router_args.api_key)
        fleet = FleetSecret.from_file(router_args.fleet_secret_file)
    except (ValueError, OSError) as exc:  # OSError: a --fleet-secret-file it cannot read
        print(f"kvpilot route: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=router_args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: the scrapes (/metrics, /ready, /kv_events of each
    # engine every --refresh-interval) were two lines per engine every 2 s. Debug keeps them.
    logging.getLogger("httpx").setLevel(max(logging.getLogger().level, logging.WARNING)
                                         if router_args.log_level != "debug" else logging.DEBUG)
    if not fleet.enabled:
        logging.getLogger("kvpilot.router").warning(UNAUTHENTICATED_WARNING)
    tokenizer = None
    if router_args.tokenizer:
        # Torch-free: the engine's tokenizer wraps `tokenizers` and jinja2 only.
        from kvpilot.engine.contracts.tokenizer import load_tokenizer
        try:
            tokenizer = load_tokenizer(router_args.tokenizer)
        except (ValueError, OSError) as exc:
            print(f"kvpilot route: {exc}", file=sys.stderr)
            return 2
    app = build_app(router_args, tokenizer=tokenizer)
    try:  # bound here: uvicorn would log a busy port over several lines and exit 1
        sock = socket.create_server((router_args.host, router_args.port),
                                    family=socket.AF_INET6 if ":" in router_args.host
                                    else socket.AF_INET, backlog=2048)
    except OSError as exc:
        print(f"kvpilot route: cannot listen on {router_args.host}:{router_args.port} "
              f"({exc.strerror or exc}): pick another --port or stop the process that holds "
              "it", file=sys.stderr)
        return 2
    # as the engine's API servers: no access-log line per request unless debugging (a
    # flood's shed requests alone were ~40 lines/s), and a GC that never walks the start-up
    # heap (a full collection of it stalled every relayed stream ~110 ms under a flood)
    config = uvicorn.Config(app, log_level=router_args.log_level, timeout_graceful_shutdown=5,
                            access_log=router_args.log_level == "debug")
    settle_gc()
    with sock:
        uvicorn.Server(config).run(sockets=[sock])
    return 0
