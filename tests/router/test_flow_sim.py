"""`kvpilot sim --flows`: the router's flow-control rules in front of modelled replicas."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from kvpilot.cli.main import main
from kvpilot.engine.router.flow_sim import FlowScenario, FlowSpec, compare, simulate_flows

FLOOD = (FlowSpec("A", 30.0), FlowSpec("B", 2.0))


def scenario(flows: tuple[FlowSpec, ...], per_flow: int = 16) -> FlowScenario:
    return FlowScenario(flows, duration_s=60.0, max_queued_per_flow=per_flow,
                        max_queued_requests=32)


def test_flow_control_bounds_the_quiet_flows_ttft_and_sheds_the_flood():
    out = compare(scenario(FLOOD))
    on, off = out["flow_control_on"], out["flow_control_off"]
    assert on["B"]["ttft_p99_s"] < 0.1 * off["B"]["ttft_p99_s"]
    assert on["B"]["shed"] == 0 and on["A"]["shed"] > 0
    assert all(flow["lost"] == 0 for result in (on, off) for flow in result.values())


@pytest.mark.parametrize("flows", [FLOOD, (FlowSpec("A", 30.0, priority=0),
                                            FlowSpec("B", 2.0, priority=5))])
def test_the_reserve_keeps_a_quiet_flows_ttft_at_its_value_alone(flows):
    """Engines do not preempt: without free slots kept, a quiet flow waits for the flood's
    requests to end; with 6 of 8 kept (its bursts fit: 2/s of ~1 s each) it never waits."""
    # 300 s: B's first request, which finds the flood holding every slot, is not its p99
    alone = simulate_flows(replace(scenario((FlowSpec("B", 2.0),)), duration_s=300.0))
    kept = simulate_flows(replace(scenario(flows), duration_s=300.0,
                                  reserved_slots_fraction=0.75))
    none = simulate_flows(replace(scenario(flows), duration_s=300.0,
                                  reserved_slots_fraction=0.0))
    assert kept["B"]["ttft_p99_s"] <= 1.5 * alone["B"]["ttft_p99_s"]
    assert none["B"]["ttft_p99_s"] > 5 * alone["B"]["ttft_p99_s"]
    assert kept["A"]["served"] < none["A"]["served"]  # what the flood pays for it
    assert all(f["lost"] == 0 for f in (*kept.values(), *none.values()))


def test_the_high_band_goes_first_and_the_low_band_is_shed():
    flows = (FlowSpec("low", 30.0, priority=0), FlowSpec("high", 6.0, priority=5))
    on = simulate_flows(scenario(flows, per_flow=32))
    assert on["high"]["shed"] == 0 and on["low"]["shed"] > 0
    assert on["high"]["ttft_p99_s"] < on["low"]["ttft_p50_s"]


def test_kvpilot_sim_flows_prints_both_runs(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"flows": [{"name": "B", "rate": 2.0}], "duration_s": 10}))
    assert main(["sim", "--flows", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["flow_control_on"]["B"]["sent"] == out["flow_control_off"]["B"]["sent"] > 0


@pytest.mark.parametrize(("data", "message"), [
    ({"flows": []}, "flows must be a non-empty list"),
    ({"flows": [{"name": "a", "rate": 0}]}, r"flows\[0\].rate"),
    ({"flows": [{"name": "a", "rate": 1, "weight": 2}]}, "weight"),
    ({"flows": [{"name": "a", "rate": 1}], "replica": 2}, "unknown scenario field"),
])
def test_a_bad_scenario_names_the_field(tmp_path, capsys, data, message):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    assert main(["sim", "--flows", str(path)]) == 2
    assert re.search(message, capsys.readouterr().err)
