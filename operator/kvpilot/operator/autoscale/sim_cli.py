"""The `kvpilot sim` subcommand: simulate a fleet under the real autoscaling policy."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the simulator's flags."""
    parser.add_argument("--trace", default="diurnal",
                        choices=("diurnal", "bursty", "step", "steady"))
    parser.add_argument("--duration", type=float, default=86_400.0, metavar="SECONDS")
    parser.add_argument("--tick", type=float, default=1.0, metavar="SECONDS",
                        help="fluid time step (control events stay exact)")
    parser.add_argument("--models", type=int, default=1,
                        help="models (each a prefill and a decode pool) sharing --peak-rps")
    parser.add_argument("--peak-rps", type=float, default=200.0,
                        help="peak request rate of the whole fleet")
    parser.add_argument("--step-at", type=float, default=600.0, metavar="SECONDS",
                        help="when the step trace jumps 4x")
    parser.add_argument("--aggregated", action="store_true",
                        help='one pool of role "both" per model instead of prefill + decode')
    parser.add_argument("--gpu-budget", type=int, default=None,
                        help="GPUs each model's two pools may hold together")
    parser.add_argument("--calibration", default=None,
                        help="cost model JSON (default: the packaged calibration.json)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-static", action="store_true",
                        help="also run static provisioning: each pool sized at the policy's "
                             "targets for its peak load")
    parser.add_argument("--png", default=None, help="draw load and replicas to this PNG")
    parser.add_argument("--json", default=None, help="write the report to this JSON file")


def run(args: argparse.Namespace) -> int:
    """Runs the simulation, prints the report; gives the exit code."""
    from kvpilot.operator.autoscale.sim.calibration import DEFAULT_PATH, load
    from kvpilot.operator.autoscale.sim.fleet import (
        SimConfig,
        aggregated_specs,
        simulate,
        static_for_peak,
    )
    from kvpilot.operator.autoscale.sim.report import first_scale_up_after, summarize

    try:
        cost = load(args.calibration or DEFAULT_PATH)
    except (OSError, ValueError, TypeError) as exc:
        print(f"kvpilot sim: error: --calibration: {exc}", file=sys.stderr)
        return 2
    base = {"trace": args.trace, "duration_s": args.duration, "tick_s": args.tick,
            "models": args.models, "peak_rps": args.peak_rps, "seed": args.seed,
            "step_at_s": args.step_at, "cost": cost, "gpu_budget": args.gpu_budget,
            "aggregated": args.aggregated}
    if args.aggregated:
        base["specs"] = aggregated_specs()
    started = time.perf_counter()
    cfg = SimConfig(**base)
    trace = simulate(cfg)
    report = summarize(trace, cfg.workload, cost)
    out: dict[str, object] = {"autoscaled": report.to_json(),
                              "wall_seconds": round(time.perf_counter() - started, 2),
                              "peak_gpus": int(trace.replicas.sum(axis=1).max())
                              * cost.gpus_per_replica}
    if args.trace == "step":
        out["first_scale_up_after_step_s"] = first_scale_up_after(trace.events, args.step_at)
    if args.compare_static:
        static = SimConfig(**base, static_replicas=static_for_peak(trace, cfg))
        fixed = summarize(simulate(static), static.workload, cost)
        out["static_for_peak"] = fixed.to_json()
        out["gpu_hours_saved"] = round(1 - report.gpu_hours / fixed.gpu_hours, 4)
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if args.png:
        from kvpilot.operator.autoscale.sim.plot import draw

        try:
            draw(trace, args.png,
                 f"{args.trace}: {args.models} model(s), peak {args.peak_rps:g} rps",
                 cfg.workload)
        except RuntimeError as exc:
            print(f"kvpilot sim: error: --png: {exc}", file=sys.stderr)
            return 2
    return 0

