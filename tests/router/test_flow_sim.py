"""`kvpilot sim --flows`: the router's flow-control rules in front of modelled replicas."""

from __future__ import annotations

import json
import re

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
