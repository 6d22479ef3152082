"""The autoscaler's simulated acceptance numbers, side by side with static provisioning.

Step (4x): seconds to the first scale-up decision. Steady noisy load: the most
direction changes of any pool in any 5 minutes, over several seeds. Diurnal day:
SLO attainment and GPU-hours against static provisioning for the peak (every pool
sized at the policy's targets for its peak load).
Bursty: SLO attainment. Draws the diurnal and step runs as PNGs.

    .venv/bin/python bench/sim_acceptance.py

Writes bench/results/sim_acceptance.json, .md and sim_{diurnal,step,bursty}.png.
"""

from __future__ import annotations

import json
import os
import platform
from datetime import date
from pathlib import Path

from kvpilot.operator.autoscale.sim.fleet import (
    SimConfig,
    aggregated_specs,
    simulate,
    static_for_peak,
)
from kvpilot.operator.autoscale.sim.plot import draw
from kvpilot.operator.autoscale.sim.report import first_scale_up_after, summarize

RESULTS = Path(__file__).resolve().parent / "results"


def run(**kwargs):  # type: ignore[no-untyped-def]
    cfg = SimConfig(**kwargs)
    trace = simulate(cfg)
    return cfg, trace, summarize(trace, cfg.workload, cfg.cost)


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    out: dict[str, object] = {"date": date.today().isoformat(),
                              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}

    cfg, trace, step = run(trace="step", duration_s=1800, step_at_s=600, peak_rps=200)
    out["calibration"] = cfg.cost.source
    out["step"] = {"first_scale_up_after_step_s": first_scale_up_after(trace.events, 600),
                   "goal_s": 30, **step.to_json()}
    draw(trace, RESULTS / "sim_step.png", "4x step at 10 min (1 model, 50 -> 200 rps)")

    flaps = []
    for seed in range(8):
        _, _, steady = run(trace="steady", duration_s=3600, peak_rps=200, models=4, seed=seed)
        flaps.append(steady.max_direction_changes_per_5min)
    out["steady"] = {"seeds": 8, "models": 4, "max_direction_changes_per_5min": max(flaps),
                     "per_seed": flaps, "goal": 1}

    cfg, trace, auto = run(trace="diurnal", peak_rps=400, tick_s=2.0)
    _, _, static = run(trace="diurnal", peak_rps=400, tick_s=2.0,
                       static_replicas=static_for_peak(trace, cfg))
    out["diurnal"] = {"autoscaled": auto.to_json(), "static_for_peak": static.to_json(),
                      "gpu_hours_saved": round(1 - auto.gpu_hours / static.gpu_hours, 4),
                      "goal": {"slo_attainment": 0.95, "gpu_hours_saved": 0.30}}
    draw(trace, RESULTS / "sim_diurnal.png", "diurnal day (1 model, peak 400 rps)")

    cfg, trace, agg = run(trace="diurnal", peak_rps=400, tick_s=2.0, aggregated=True,
                          specs=aggregated_specs())
    _, _, agg_static = run(trace="diurnal", peak_rps=400, tick_s=2.0, aggregated=True,
                           specs=aggregated_specs(), static_replicas=static_for_peak(trace, cfg))
    out["diurnal_aggregated"] = {
        "autoscaled": agg.to_json(), "static_for_peak": agg_static.to_json(),
        "gpu_hours_saved": round(1 - agg.gpu_hours / agg_static.gpu_hours, 4)}

    _, trace, bursty = run(trace="bursty", duration_s=7200, peak_rps=400)
    out["bursty"] = bursty.to_json()
    draw(trace, RESULTS / "sim_bursty.png", "bursty 2 h (1 model, peak 400 rps)")

    print(json.dumps(out, indent=2))
    (RESULTS / "sim_acceptance.json").write_text(json.dumps(out, indent=2) + "\n")
    d = out["diurnal"]
    (RESULTS / "sim_acceptance.md").write_text(
        f"# Autoscaler in the fleet simulator ({out['date']}, {out['machine']})\n\n"
        f"Cost model: {out['calibration']}\n\n"
        "| check | measured | goal |\n|---|---|---|\n"
        f"| 4x step: first scale-up decision | {out['step']['first_scale_up_after_step_s']:.1f} s"
        " after the step | <= 30 s |\n"
        f"| noisy steady load, 8 seeds x 8 pools, 1 h | max {max(flaps)} direction change(s) "
        "per 5 min | <= 1 |\n"
        f"| diurnal day: SLO attainment | {d['autoscaled']['slo_attainment']:.4f} "
        f"(static for the peak: {d['static_for_peak']['slo_attainment']:.4f}) | >= 0.95 |\n"
        f"| diurnal day: GPU-hours | {d['autoscaled']['gpu_hours']:.0f} vs static "
        f"{d['static_for_peak']['gpu_hours']:.0f} ({d['gpu_hours_saved']:.1%} fewer) | "
        ">= 30% fewer |\n"
        f"| diurnal day, aggregated pools: SLO, GPU-hours | "
        f"{agg.slo_attainment:.4f}, {agg.gpu_hours:.0f} vs static {agg_static.gpu_hours:.0f} "
        f"({out['diurnal_aggregated']['gpu_hours_saved']:.1%} fewer) | >= 0.95, >= 30% fewer |\n"
        f"| bursty 2 h: SLO attainment | {bursty.slo_attainment:.4f} | (reported) |\n"
        f"| 4x step 30 min: SLO attainment | {step.slo_attainment:.4f} | (reported) |\n\n"
        "Plots: sim_step.png, sim_diurnal.png, sim_bursty.png. "
        "Reproduce: `.venv/bin/python bench/sim_acceptance.py`.\n")


if __name__ == "__main__":
    main()
