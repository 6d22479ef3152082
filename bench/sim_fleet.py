"""How long the simulator takes for a 10,000-GPU fleet over a day (goal: under 60 s).

    .venv/bin/python bench/sim_fleet.py [--models 32] [--peak-rps 196000] [--tick 1]

Writes bench/results/sim_fleet.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import date
from pathlib import Path

from kvpilot.operator.autoscale.sim.fleet import SimConfig, simulate
from kvpilot.operator.autoscale.sim.report import summarize

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=32)
    parser.add_argument("--peak-rps", type=float, default=196_000.0)
    parser.add_argument("--tick", type=float, default=1.0)
    args = parser.parse_args()
    cfg = SimConfig(trace="diurnal", duration_s=86_400, tick_s=args.tick, models=args.models,
                    peak_rps=args.peak_rps)
    start = time.perf_counter()
    trace = simulate(cfg)
    simulated = time.perf_counter() - start
    report = summarize(trace, cfg.workload, cfg.cost)
    total = time.perf_counter() - start
    peak_gpus = int(trace.replicas.sum(axis=1).max()) * cfg.cost.gpus_per_replica
    decisions = 2 * args.models * int(86_400 / cfg.specs[0].interval_seconds)
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
                   "(shared with other jobs)",
        "date": date.today().isoformat(), "models": args.models, "pools": 2 * args.models,
        "tick_s": args.tick, "peak_gpus": peak_gpus, "policy_decisions": decisions,
        "simulate_s": round(simulated, 1), "simulate_and_report_s": round(total, 1),
        "goal_s": 60.0, "time_of_goal": round(total / 60.0, 2), "report": report.to_json(),
    }
    print(json.dumps(out, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sim_fleet.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / "sim_fleet.md").write_text(
        f"# Fleet simulator speed ({out['date']}, {out['machine']})\n\n"
        "| fleet | pools | policy decisions | tick | simulate | + report | goal |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {peak_gpus} GPUs at peak, 1 day diurnal | {2 * args.models} | {decisions} | "
        f"{args.tick} s | {simulated:.1f} s | {total:.1f} s | < 60 s |\n\n"
        f"SLO attainment {report.slo_attainment:.4f}, {report.gpu_hours:.0f} GPU-hours, "
        f"{report.scale_events} scale events, {report.requests:.3g} requests.\n"
        "Reproduce: `.venv/bin/python bench/sim_fleet.py`.\n")


if __name__ == "__main__":
    main()
