"""The router's view of the host tier: KV events name the tier, the prefix index remembers
both tiers per block, and the prefix-aware policy scores a host hit between a GPU hit and
a miss."""

from __future__ import annotations

import pytest
from helpers.engine_run import run
from kv_tier_helpers import BLOCK, PROMPT, evict, make_engine

from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.router.kv_events import parse_event
from kvpilot.engine.router.policy import InstanceView, Weights, choose, hit_blocks
from kvpilot.engine.router.prefix_index import PrefixIndex

HASHES = [11, 12, 13, 14]


def index_after(*events: dict) -> PrefixIndex:
    index = PrefixIndex(100)
    for event in events:
        index.apply("a", parse_event(event))
    return index


@pytest.mark.parametrize(("events", "tiers"), [
    ([{"stored": HASHES}], (4, 0)),
    # evicted from the GPU, copied to host: still held, as host hits
    ([{"stored": HASHES}, {"removed": HASHES}, {"stored": HASHES, "tier": "host"}], (0, 4)),
    # loaded back: GPU hits again (the host copy stays)
    ([{"stored": HASHES, "tier": "host"}, {"stored": HASHES}], (4, 0)),
    # the host copy dropped while the GPU holds the block: still a GPU hit
    ([{"stored": HASHES}, {"stored": HASHES, "tier": "host"},
      {"removed": HASHES, "tier": "host"}], (4, 0)),
    # gone from both tiers
    ([{"stored": HASHES[:2], "tier": "host"}, {"removed": HASHES[:2], "tier": "host"}], (0, 0)),
    # a GPU prefix and its tail in host memory (the GPU evicts a prompt's tail first)
    ([{"stored": HASHES[:2]}, {"stored": HASHES[2:], "tier": "host"}], (2, 2)),
])
def test_index_keeps_each_blocks_tiers(events, tiers):
    index = index_after(*events)
    assert index.match_tiers("a", HASHES) == tiers
    assert index.match("a", HASHES) == sum(tiers)
    assert index.size("a") == sum(tiers)


def test_an_unknown_tier_is_refused_by_name():
    with pytest.raises(ValueError, match="tier="):
        parse_event({"stored": [1], "tier": "disk"})


@pytest.mark.parametrize(("held", "expected"), [
    # same load: the GPU hit wins, then the host hit beats a miss
    ({"gpu": (4, 0), "host": (0, 4), "miss": (0, 0)}, "gpu"),
    ({"host": (0, 4), "miss": (0, 0)}, "host"),
    # a host hit of the whole prompt beats a GPU hit of a quarter of it
    ({"gpu": (1, 0), "host": (0, 4)}, "host"),
])
def test_prefix_aware_scores_a_host_hit_between_a_gpu_hit_and_a_miss(held, expected):
    weights = Weights()
    views = [InstanceView(url) for url in held]
    hits = {url: hit_blocks(gpu, host, weights) for url, (gpu, host) in held.items()}
    for counter in range(len(views)):  # whatever the tie-break rotation
        chosen = choose("prefix-aware", views, counter=counter, hits=hits, num_blocks=4,
                        weights=weights)
        assert chosen.url == expected


def test_a_real_engines_events_show_its_host_hits_to_the_router():
    engine = make_engine(0.001)
    run(engine, "first", PROMPT)
    evict(engine, "x")
    index = PrefixIndex(10_000)
    for event in engine.kv_events.read(0)["events"]:
        index.apply("engine", parse_event(event))
    assert index.match_tiers("engine", hash_prompt_blocks(PROMPT, BLOCK)) == (0, 6)
