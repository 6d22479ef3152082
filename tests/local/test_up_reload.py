"""`kvpilot up` reloads: which manifest edits are allowed, and the plan diff, table-tested."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.operator.local.plan import LocalProcess, plan_local
from kvpilot.operator.local.reload import diff_plan, unreloadable_field
from kvpilot.operator.local.scaler import refresh_interval, write_instances

TINY = yaml.safe_load((Path(__file__).parents[2] / "examples" / "tiny-cpu.yaml").read_text())
DISAGG = {"servingMode": "disaggregated", "prefill": {"replicas": 1}, "decode": {"replicas": 2}}


def edited(base: dict, **spec_changes) -> dict:
    out = copy.deepcopy(base)
    for key, value in spec_changes.items():
        if isinstance(value, dict) and isinstance(out["spec"].get(key), dict):
            out["spec"][key] = {**out["spec"][key], **value}
        else:
            out["spec"][key] = value
    return out


@pytest.mark.parametrize(("changes", "expected"), [
    ({}, None),
    ({"decode": {"replicas": 3}}, None),
    ({"decode": {"replicas": 0}}, None),
    ({"engine": {"dtype": "bfloat16"}}, "spec.engine.dtype"),
    ({"engine": {"maxNumSeqs": 8}}, "spec.engine.maxNumSeqs"),
    ({"router": {"replicas": 2}}, "spec.router.replicas"),
    ({"router": {"policy": "round-robin"}}, "spec.router.policy"),
    ({"decode": {"replicas": 2, "topology": {"tensorParallel": 1}}}, "spec.decode.topology"),
    ({"servingMode": "disaggregated"}, "spec.servingMode"),
    ({"model": {"name": "other"}}, "spec.model.name"),
])
def test_unreloadable_field_table(changes, expected):
    assert unreloadable_field(TINY, edited(TINY, **changes)) == expected


def test_prefill_replicas_reload_in_a_disaggregated_manifest():
    base = edited(TINY, **DISAGG)
    assert unreloadable_field(base, edited(base, prefill={"replicas": 3})) is None
    assert unreloadable_field(base, edited(base, prefill=None)) == "spec.prefill"


def plan(**spec_changes) -> list[LocalProcess]:
    ports = itertools.count(9000)
    return plan_local(edited(TINY, **spec_changes), lambda: next(ports), 8080)[0]


def engine(pool: str, index: int) -> LocalProcess:
    return LocalProcess(f"{pool}-{index}", "both", [], {}, 7000 + index, pool)


POOL = plan()[0].pool  # the tiny manifest's decode Deployment name


@pytest.mark.parametrize(("running", "replicas", "start", "stop"), [
    ([0, 1, 2], 3, [], {}),
    ([0, 1, 2], 1, [], {POOL: 2}),
    ([0, 1, 2], 0, [], {POOL: 3}),
    ([0], 2, [1], {}),
    ([1], 2, [0], {}),            # a scale-down left replica 1: the new one reuses name 0
    ([2], 3, [0, 1], {}),
    ([], 2, [0, 1], {}),
    ([5, 7], 3, [0], {}),         # running names outside the plan's range still count
])
def test_diff_plan_table(running, replicas, start, stop):
    actions = diff_plan([engine(POOL, i) for i in running], plan(decode={"replicas": replicas}))
    assert [p.name for p in actions.start] == [f"{POOL}-{i}" for i in start]
    assert actions.stop == stop


@given(st.sets(st.integers(0, 9), max_size=6), st.integers(0, 6))
def test_diff_plan_reaches_the_planned_count(running, replicas):
    actions = diff_plan([engine(POOL, i) for i in running], plan(decode={"replicas": replicas}))
    names = {f"{POOL}-{i}" for i in running}
    assert not names & {p.name for p in actions.start}  # never a running name twice
    assert len(running) + len(actions.start) - actions.stop.get(POOL, 0) == replicas


def test_instances_file_and_refresh_interval(tmp_path):
    from kvpilot.engine.contracts.router_args import parse_instances

    path = tmp_path / "instances"
    write_instances(path, [engine("p", 0), engine("p", 1)])
    assert parse_instances(path.read_text()) == [("both", "http://127.0.0.1:7000"),
                                                ("both", "http://127.0.0.1:7001")]
    write_instances(path, [])
    assert parse_instances(path.read_text(), allow_empty=True) == []
    assert [p.name for p in tmp_path.iterdir()] == ["instances"]  # no temporary left behind
    router = LocalProcess("r", "router", ["x", "--refresh-interval", "0.5"])
    assert (refresh_interval(router), refresh_interval(LocalProcess("r", "router", []))) == (
        0.5, 2.0)
