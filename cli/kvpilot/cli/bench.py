"""The `kvpilot bench` subcommand: vLLM's three benchmarks, `serve` (an OpenAI server under
load), `throughput` and `latency` (the offline engine, in this process).

Each benchmark's module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and imports
torch only in ``run``, so ``kvpilot bench --help`` and each benchmark's ``--help`` stay light.
"""

from __future__ import annotations

import argparse
import importlib

# benchmark -> (its module, its help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "serve": ("kvpilot.engine.loadgen.cli", "stream completions at an OpenAI server and time them"),
    "throughput": ("kvpilot.engine.benchmarks.throughput",
                   "requests and tokens per second of the offline engine"),
    "latency": ("kvpilot.engine.benchmarks.latency",
                "seconds the offline engine takes to generate one batch"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one sub-subcommand per benchmark, each with its module's flags."""
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for name, (module_name, help_text) in BENCHMARKS.items():
        bench_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(bench_parser)
        bench_parser.set_defaults(_bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    """Runs the chosen benchmark; gives its exit code."""
    return int(args._bench_run(args))
