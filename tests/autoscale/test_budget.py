"""Table and property tests of the InferenceModel GPU budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.operator.autoscale.budget import PoolDemand, allocate


def pool(name: str, current: int, desired: int, load: float, lo: int = 0,
         gpus: int = 1) -> PoolDemand:
    return PoolDemand(name, current=current, desired=desired, min_replicas=lo,
                      gpus_per_replica=gpus, load=load)


CASES = [
    # id, budget, pools, expected replicas, binds
    ("fits", 20, [pool("prefill", 4, 6, 5.5), pool("decode", 8, 10, 9.5)],
     {"prefill": 6, "decode": 10}, False),
    ("binds: larger shortfall gets the GPUs", 16,
     [pool("prefill", 4, 8, 7.5), pool("decode", 8, 10, 9.0)],
     {"prefill": 7, "decode": 9}, True),
    ("binds: one pool far behind takes all", 14,
     [pool("prefill", 4, 8, 8.0), pool("decode", 8, 9, 8.2)],
     {"prefill": 6, "decode": 8}, True),
    ("tensor-parallel replicas cost more GPUs", 24,
     [pool("prefill", 2, 4, 4.0, gpus=2), pool("decode", 2, 4, 3.0, gpus=8)],
     {"prefill": 4, "decode": 2}, True),
    ("budget below holdings shrinks the least pressed", 10,
     [pool("prefill", 6, 6, 3.0), pool("decode", 6, 6, 5.5)],
     {"prefill": 4, "decode": 6}, True),
    ("minReplicas kept even over budget", 2,
     [pool("prefill", 2, 2, 2.0, lo=2), pool("decode", 2, 2, 2.0, lo=1)],
     {"prefill": 2, "decode": 1}, True),
    ("shrinking pool keeps its wish", 12,
     [pool("prefill", 6, 3, 2.5), pool("decode", 6, 12, 11.0)],
     {"prefill": 3, "decode": 9}, True),
]


@pytest.mark.parametrize(("case", "budget", "pools", "expected", "binds"), CASES,
                         ids=[c[0] for c in CASES])
def test_allocate_table(case, budget, pools, expected, binds) -> None:
    got = allocate(budget, pools)
    assert got.replicas == expected, case
    assert got.binds == binds, case


def test_message_says_where_the_gpus_went() -> None:
    got = allocate(16, [pool("prefill", 4, 8, 7.5), pool("decode", 8, 10, 9.0)])
    assert got.message == ("GPU budget 16 binds: prefill 7 of 8 wanted, decode 9 of 10 wanted; "
                           "largest shortfall prefill at 1.07x its target")


demand_st = st.builds(
    lambda name, cur, want, lo, gpus, load: PoolDemand(
        name, current=cur, desired=max(want, lo), min_replicas=lo, gpus_per_replica=gpus,
        load=load),
    st.just(""), st.integers(0, 20), st.integers(0, 20), st.integers(0, 3),
    st.sampled_from([1, 2, 4, 8]), st.floats(0, 40))


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(0, 200), raw=st.lists(demand_st, min_size=1, max_size=3))
def test_budget_invariants(budget, raw) -> None:
    """Never above a wish, never below minReplicas, within budget whenever minimums fit."""
    pools = [PoolDemand(f"p{i}", d.current, d.desired, d.min_replicas, d.gpus_per_replica,
                        d.load) for i, d in enumerate(raw)]
    got = allocate(budget, pools)
    used = sum(got.replicas[p.name] * p.gpus_per_replica for p in pools)
    floor = sum(p.min_replicas * p.gpus_per_replica for p in pools)
    for p in pools:
        assert p.min_replicas <= got.replicas[p.name] <= max(p.desired, p.min_replicas)
    if floor <= budget:
        assert used <= budget
