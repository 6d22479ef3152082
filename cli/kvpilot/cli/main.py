"""The `kvpilot` command: one entry point, subcommands imported on demand.

Each subcommand lives in its own module that exposes ``add_arguments(parser)``
and ``run(args) -> int``. Only the chosen subcommand's module is imported, and
those modules import their heavy dependencies (torch, kopf, uvicorn) inside
``run``, so ``kvpilot --help`` and ``kvpilot operator --help`` never load torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    module: str
    help: str


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand("kvpilot.engine.server.cli", "run the OpenAI-compatible engine server"),
    "generate": Subcommand("kvpilot.engine.entrypoints.offline_cli", "generate offline from prompts (no server)"),
    "route": Subcommand("kvpilot.engine.router.cli", "run the prefix- and load-aware router"),
    "up": Subcommand("kvpilot.operator.local.cli", "run an InferenceModel as local processes"),
    "operator": Subcommand("kvpilot.operator.cli", "run the Kubernetes operator (kopf)"),
    "crds": Subcommand("kvpilot.operator.crdgen", "print or write the CustomResourceDefinitions"),
    "fetch": Subcommand("kvpilot.operator.weights.cli",
                         "download model weights from the Hugging Face Hub (init containers, Jobs)"),
    "bench": Subcommand("kvpilot.cli.bench", "benchmark a server under load (serve) or the "
                        "offline engine (throughput, latency)"),
    "sim": Subcommand("kvpilot.cli.sim", "simulate a fleet under the autoscaler, or the "
                      "router's flow control (--flows)"),
}


def build_parser(selected: str | None) -> argparse.ArgumentParser:
    """Gives the top-level parser; only `selected`'s module is imported."""
    parser = argparse.ArgumentParser(
        prog="kvpilot",
        description="kvpilot: an operator for LLM inference fleets and the engine they run.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, sub in SUBCOMMANDS.items():
        sub_parser = subparsers.add_parser(name, help=sub.help, description=sub.help)
        if name == selected:
            module = importlib.import_module(sub.module)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=module.run)
    return parser


def _selected(argv: Sequence[str]) -> str | None:
    for arg in argv:
        if arg in SUBCOMMANDS:
            return arg
        if not arg.startswith("-"):
            return None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; gives the process exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_selected(args_list))
    args = parser.parse_args(args_list)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
