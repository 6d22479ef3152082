"""Routing decisions: tables of instance states with the instance each policy must pick."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.engine.router.policy import InstanceView, Weights, choose, score

A, B, C = "http://a", "http://b", "http://c"


def views(*specs: tuple) -> list[InstanceView]:
    """Gives views from (url, waiting, in_flight, kv_usage[, cached_blocks]) tuples."""
    return [InstanceView(*spec) for spec in specs]


@pytest.mark.parametrize(("policy", "instances", "hits", "num_blocks", "counter", "expected"), [
    # round-robin ignores load and hits and rotates with the counter
    ("round-robin", views((A, 9, 9, 1), (B, 0, 0, 0)), {}, 0, 0, A),
    ("round-robin", views((A, 9, 9, 1), (B, 0, 0, 0)), {}, 0, 1, B),
    ("round-robin", views((A, 0, 0, 0), (B, 0, 0, 0), (C, 0, 0, 0)), {}, 0, 5, C),
    # least-load: fewest waiting + in flight, then lowest KV usage, then rotation
    ("least-load", views((A, 2, 1, 0), (B, 0, 2, 0), (C, 4, 0, 0)), {}, 0, 0, B),
    ("least-load", views((A, 1, 0, 0.9), (B, 0, 1, 0.2)), {}, 0, 0, B),
    ("least-load", views((A, 0, 0, 0), (B, 0, 0, 0)), {}, 0, 1, B),
    # prefix-aware: the instance holding the prefix wins at equal load ...
    ("prefix-aware", views((A, 0, 0, 0), (B, 0, 0, 0)), {B: 8}, 10, 0, B),
    # ... and at a moderately higher load (hit 0.8 outweighs load cost 0.5 * 3/4)
    ("prefix-aware", views((A, 0, 0, 0), (B, 3, 0, 0)), {B: 8}, 10, 0, B),
    # ... but not when the hit is small and the instance is the busiest
    ("prefix-aware", views((A, 0, 0, 0), (B, 3, 0, 0)), {B: 1}, 10, 0, A),
    # no hits anywhere: lowest load, then lowest KV usage
    ("prefix-aware", views((A, 2, 0, 0), (B, 0, 0, 0)), {}, 10, 0, B),
    ("prefix-aware", views((A, 0, 0, 0.9), (B, 0, 0, 0.1)), {}, 10, 0, B),
    # a longer match beats a shorter one
    ("prefix-aware", views((A, 0, 0, 0), (B, 0, 0, 0)), {A: 3, B: 6}, 10, 0, B),
    # empty prompt (no full block): behaves like least-load with rotation
    ("prefix-aware", views((A, 0, 0, 0), (B, 0, 0, 0)), {}, 0, 1, B),
    # a new prefix at equal load goes to the instance caching the least
    ("prefix-aware", views((A, 0, 0, 0, 900), (B, 0, 0, 0, 100)), {}, 10, 0, B),
    # ... but the cached-data cost never outweighs a real hit
    ("prefix-aware", views((A, 0, 0, 0, 900), (B, 0, 0, 0, 100)), {A: 2}, 10, 0, A),
    # ... nor a real load difference
    ("prefix-aware", views((A, 0, 0, 0, 900), (B, 2, 0, 0, 100)), {}, 10, 0, A),
])
def test_choose_table(policy, instances, hits, num_blocks, counter, expected):
    chosen = choose(policy, instances, counter=counter, hits=hits, num_blocks=num_blocks)
    assert chosen.url == expected


@pytest.mark.parametrize(("view", "hit", "blocks", "max_load", "expected"), [
    (InstanceView(A), 10, 10, 0, 1.0),
    (InstanceView(A, waiting=1, in_flight=1), 5, 10, 3, 0.5 - 0.5 * 2 / 4),
    (InstanceView(A, kv_usage=0.8), 0, 10, 0, -0.25 * 0.8),
    (InstanceView(A), 0, 0, 0, 0.0),
    (InstanceView(A, cached_blocks=99), 0, 10, 0, -0.05 * 99 / 100),
])
def test_score_table(view, hit, blocks, max_load, expected):
    assert score(view, hit, blocks, max_load, Weights(), max_cached=view.cached_blocks) == (
        pytest.approx(expected))


@pytest.mark.parametrize(("policy", "instances", "error"), [
    ("round-robin", [], "no instance"),
    ("random", views((A, 0, 0, 0)), "policy='random' is invalid"),
])
def test_choose_errors(policy, instances, error):
    with pytest.raises(ValueError, match=error):
        choose(policy, instances)


loads = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.floats(0, 1)),
                 min_size=1, max_size=6)


@given(loads, st.sampled_from(["round-robin", "least-load", "prefix-aware"]),
       st.integers(0, 1000), st.data())
def test_choice_is_always_a_candidate(specs, policy, counter, data):
    instances = [InstanceView(f"http://{i}", w, f, kv) for i, (w, f, kv) in enumerate(specs)]
    hits = {v.url: data.draw(st.integers(0, 8)) for v in instances}
    chosen = choose(policy, instances, counter=counter, hits=hits, num_blocks=8)
    assert chosen in instances
    if policy == "least-load":
        assert chosen.load == min(v.load for v in instances)


@given(st.integers(1, 6), st.integers(0, 100))
def test_round_robin_visits_every_instance_once_per_cycle(n, start):
    instances = [InstanceView(f"http://{i}") for i in range(n)]
    picked = {choose("round-robin", instances, counter=start + k).url for k in range(n)}
    assert picked == {v.url for v in instances}


@given(loads, st.integers(1, 16))
def test_full_hit_at_equal_load_always_wins(specs, num_blocks):
    # Same load everywhere: only the hit differs, so the holder of the whole prompt wins.
    instances = [InstanceView(f"http://{i}", 1, 1, 0.5) for i in range(len(specs))]
    holder = instances[-1].url
    chosen = choose("prefix-aware", instances, hits={holder: num_blocks}, num_blocks=num_blocks)
    assert chosen.url == holder
