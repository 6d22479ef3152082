"""Property tests: every block is free xor owned, ref counts match owners, nothing leaks."""

from __future__ import annotations

from collections import Counter

import pytest
from core_helpers import make_request, make_scheduler, run_step
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.core.block_pool import BlockPool


def check_invariants(scheduler) -> None:
    kv = scheduler.kv
    pool = kv.pool
    owners = Counter(b.block_id for table in kv.block_tables.values() for b in table)
    for block in pool.blocks:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == owners[block.block_id]
        assert (block.ref_cnt == 0) == (block.block_id in pool.free_queue)
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    live = {s.seq_id for s in scheduler.running}
    assert set(kv.block_tables) <= live | {s.seq_id for s in scheduler.waiting}
    for seq in scheduler.waiting:
        assert seq.num_computed_tokens == 0 and seq.seq_id not in kv.block_tables


# ops: (kind, argument); arguments index into the live requests modulo their count
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30)),
    st.tuples(st.just("step"), st.integers(0, 0)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("fork"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, num_blocks=st.integers(8, 24), caching=st.booleans(),
       budget=st.sampled_from([4, 16, 64]))
def test_random_operations_keep_the_pool_consistent(ops, num_blocks, caching, budget):
    s = make_scheduler(num_blocks=num_blocks, block_size=4, caching=caching,
                       max_num_batched_tokens=budget, max_model_len=64)
    requests = []
    for i, (kind, arg) in enumerate(ops):
        live = [seq for r in requests for seq in r.live_seqs()]
        if kind == "add":
            # few distinct token ids so prompts share cached prefixes
            request = make_request(f"r{i}", [10 + (j % 3) for j in range(arg)], max_tokens=6)
            if s.never_fits(request) is None:
                requests.append(request)
                s.add(request.seqs[0])
        elif kind == "step":
            run_step(s, next_token=10 + i % 3)
        elif live and kind in ("abort", "finish"):
            seq = live[arg % len(live)]
            for victim in (seq.request.live_seqs() if kind == "abort" else [seq]):
                s.remove(victim)
        elif live and kind == "fork":
            parent = live[arg % len(live)]
            child = parent.fork()
            s.kv.fork(parent, child)
            if parent in s.running:
                s.add_running(child)
            else:
                s.add(child)
        elif kind == "preempt" and s.running:
            plan_out = type("Out", (), {"preempted": []})()
            s._preempt(s.running[arg % len(s.running)], plan_out)
        check_invariants(s)
    for request in requests:
        for seq in request.live_seqs():
            s.remove(seq)
    check_invariants(s)
    assert s.kv.pool.num_free_blocks == num_blocks


@pytest.mark.parametrize(("ops", "free_order"), [
    # freed blocks join the tail: least recently freed are handed out first
    ([("alloc", 3), ("free", [2, 1, 0])], [2, 1, 0]),
    ([("alloc", 2), ("free", [0]), ("free", [1])], [0, 1]),
])
def test_free_queue_is_least_recently_freed_first(ops, free_order):
    pool = BlockPool(3)
    blocks = []
    for kind, arg in ops:
        if kind == "alloc":
            blocks = pool.allocate(arg)
        else:
            pool.free([blocks[i] for i in arg])
    assert list(pool.free_queue)[-len(free_order):] == free_order


def test_a_hit_on_a_freed_cached_block_revives_it_and_eviction_forgets_it():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, 1234)
    pool.free([a])
    assert pool.lookup(1234) is a and a.ref_cnt == 0
    pool.touch([a])
    assert a.ref_cnt == 1 and a.block_id not in pool.free_queue
    pool.free([a])
    pool.allocate(2)  # hands out both free blocks, evicting the cached one
    assert pool.lookup(1234) is None and a.block_hash is None


def test_freeing_a_free_block_is_an_error():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError, match="ref_cnt 0"):
        pool.free([a])
