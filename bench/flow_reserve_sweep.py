"""The flow-control simulator over the reserve of free slots (`reservedSlotsFraction`).

For each scenario of bench/flow_scenarios with a quiet flow, runs `kvpilot sim --flows`'s
model with the engines' slots known to the router and the reserve at each fraction, and
the quiet flow alone: its TTFT p50/p99, their ratio to alone, and what the pool served.

    python bench/flow_reserve_sweep.py > bench/results/<dir>/sim_reserve_sweep.json
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from kvpilot.engine.router.flow_sim import FlowScenario, simulate_flows

SCENARIOS = Path(__file__).parent / "flow_scenarios"
QUIET = {"noisy_neighbour": "B", "priorities": "high"}
FRACTIONS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75)


def sweep(name: str, quiet: str) -> dict:
    base = FlowScenario.from_json(json.loads((SCENARIOS / f"{name}.json").read_text()))
    alone = simulate_flows(replace(base, flows=tuple(f for f in base.flows
                                                     if f.name == quiet)))[quiet]
    rows = []
    for label, scenario in [("queue depth (slots unknown)", replace(base, slots_known=False)),
                            *((f"slots, reserve {f}", replace(base, reserved_slots_fraction=f))
                              for f in FRACTIONS)]:
        out = simulate_flows(scenario)
        rows.append({"rule": label, "quiet_ttft_p50_s": out[quiet]["ttft_p50_s"],
                     "quiet_ttft_p99_s": out[quiet]["ttft_p99_s"],
                     "p99_ratio_to_alone": out[quiet]["ttft_p99_s"] / alone["ttft_p99_s"],
                     "served_per_s": {k: v["served"] / base.duration_s for k, v in out.items()},
                     "shed": {k: v["shed"] for k, v in out.items()},
                     "lost": sum(v["lost"] for v in out.values())})
    return {"quiet_alone": alone, "rows": rows}


if __name__ == "__main__":
    print(json.dumps({name: sweep(name, quiet) for name, quiet in QUIET.items()}, indent=1))
