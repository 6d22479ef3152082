"""The prefix cache's event ring (stored / removed / cleared) and the engine feeding it."""

from __future__ import annotations

import pytest
from core_helpers import run_engine
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.core.block_pool import BlockPool
from kvpilot.engine.core.kv_events import KVEventLog
from kvpilot.engine.engine_loop.llm_engine import LLMEngine

CLEARED = {"cleared": True}


def play(log: KVEventLog, ops: list[tuple[str, int]]) -> None:
    for kind, block_hash in ops:
        if kind == "cleared":
            log.cleared()
        else:
            getattr(log, kind)(block_hash)


@pytest.mark.parametrize(("capacity", "ops", "since", "limit", "expected"), [
    # in order, runs of one kind merged
    (8, [("stored", 1), ("stored", 2), ("removed", 1), ("stored", 3)], 0, None,
     {"next": 4, "events": [{"stored": [1, 2]}, {"removed": [1]}, {"stored": [3]}]}),
    # only what came after `since`
    (8, [("stored", 1), ("stored", 2), ("removed", 1)], 2, None,
     {"next": 3, "events": [{"removed": [1]}]}),
    # nothing new
    (8, [("stored", 1)], 1, None, {"next": 1, "events": []}),
    # cleared is its own event, between runs
    (8, [("stored", 1), ("cleared", 0), ("stored", 1)], 0, None,
     {"next": 3, "events": [{"stored": [1]}, CLEARED, {"stored": [1]}]}),
    # 64-bit hashes survive the negative encoding of removals
    (8, [("removed", 2**64 - 1), ("removed", 0)], 0, None,
     {"next": 2, "events": [{"removed": [2**64 - 1, 0]}]}),
    # the reader fell behind the cap: cleared, then the last `capacity` events
    (3, [("stored", 1), ("stored", 2), ("stored", 3), ("removed", 2), ("stored", 4)], 1, None,
     {"next": 5, "events": [CLEARED, {"stored": [3]}, {"removed": [2]}, {"stored": [4]}]}),
    # exactly at the cap is not a gap
    (3, [("stored", 1), ("stored", 2), ("stored", 3), ("stored", 4)], 1, None,
     {"next": 4, "events": [{"stored": [2, 3, 4]}]}),
    # asking past `next` (the engine restarted): cleared + everything held
    (8, [("stored", 5)], 9, None, {"next": 1, "events": [CLEARED, {"stored": [5]}]}),
    # a limit bounds the answer; the next read continues from `next`
    (8, [("stored", 1), ("stored", 2), ("stored", 3)], 0, 2,
     {"next": 2, "events": [{"stored": [1, 2]}]}),
])
def test_ring_read_table(capacity, ops, since, limit, expected):
    log = KVEventLog(capacity)
    play(log, ops)
    assert log.read(since, limit) == expected


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity=0 is invalid"):
        KVEventLog(0)


ops_strategy = st.lists(st.tuples(st.sampled_from(["stored", "removed", "cleared"]),
                                  st.integers(0, 2**64 - 1)), max_size=40)


@given(ops_strategy, st.integers(1, 16), st.data())
def test_incremental_reads_replay_exactly_the_events(ops, capacity, data):
    """Reading in chunks small enough to keep up gives every event once, in order."""
    log = KVEventLog(capacity)
    seen: list[dict] = []
    since, done = 0, 0
    while done < len(ops):
        step = data.draw(st.integers(1, capacity))
        play(log, ops[done:done + step])
        done += min(step, len(ops) - done)
        answer = log.read(since)
        seen += answer["events"]
        since = answer["next"]
    flat = [(k, h) for e in seen for k, hs in e.items() for h in (hs if k != "cleared" else [0])]
    assert flat == [(k, 0 if k == "cleared" else h) for k, h in ops]


def test_block_pool_records_cache_evict_and_reset():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, 11)
    pool.cache(b, 22)
    pool.cache(b, 22)  # already cached: no second event
    pool.free([b, a])
    pool.allocate(1)  # reuses b (freed first): evicts 22
    pool.reset_prefix_cache()
    assert pool.events.read(0)["events"] == [{"stored": [11, 22]}, {"removed": [22]}, CLEARED]


def test_engine_eviction_of_a_cached_block_yields_a_removed_event():
    engine = LLMEngine.from_engine_args(EngineArgs(model="tiny-llama", num_kv_blocks=8,
                                                   max_model_len=256))
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = list(range(100, 132))  # two full blocks of 16
    engine.add_request("a", first, greedy)
    run_engine(engine)
    prefix = hash_prompt_blocks(first, 16)
    after_first = engine.kv_events.read(0)
    assert after_first["events"] == [{"stored": prefix}]
    # 120 new tokens need all 8 blocks: the first prompt's cached blocks are evicted
    engine.add_request("b", list(range(300, 420)), greedy)
    run_engine(engine)
    later = engine.kv_events.read(after_first["next"])["events"]
    removed = [h for e in later for h in e.get("removed", [])]
    assert sorted(removed) == sorted(prefix)
