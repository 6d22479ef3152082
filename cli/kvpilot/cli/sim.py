"""The `kvpilot sim` subcommand: the fleet simulator (autoscaling), or with `--flows` the
router's flow control in front of modelled replicas.

Here, in the composition root, because the two simulators live in the two halves: the
autoscaler's in `kvpilot.operator`, the flows' beside the router rules it runs
(`kvpilot.engine.router.flow_sim`), which the operator never imports.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvpilot.operator.autoscale import sim_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the autoscaling simulator's flags and --flows."""
    sim_cli.add_arguments(parser)
    parser.add_argument("--flows", default=None, metavar="SCENARIO.json",
                        help="simulate the router's flow control instead: a JSON object with "
                             "flows [{name, rate, priority, prompt_tokens, output_tokens}] and "
                             "the fleet (replicas, max_num_seqs, prefill_tokens_per_s, "
                             "decode_step_s, duration_s, saturation_queue_depth, "
                             "max_queued_per_flow, max_queued_requests, queue_timeout_s); "
                             "prints each flow's outcome with flow control on and off")


def run(args: argparse.Namespace) -> int:
    """Runs the chosen simulation; gives the exit code."""
    if args.flows is None:
        return sim_cli.run(args)
    from kvpilot.engine.router.flow_sim import FlowScenario, compare

    try:
        with open(args.flows) as f:
            scenario = FlowScenario.from_json(json.load(f))
    except (OSError, ValueError, TypeError) as exc:
        print(f"kvpilot sim: error: --flows: {exc}", file=sys.stderr)
        return 2
    out = compare(scenario)
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
