"""HostKVPool: bounded rows by hash, LRU over unpinned entries, drops when all are pinned,
and the events the engine publishes for the router."""

from __future__ import annotations

import pytest

from kvpilot.engine.kv_connector.host_pool import HostKVPool


def filled(num_blocks: int, hashes: list[int]) -> HostKVPool:
    pool = HostKVPool(num_blocks, block_bytes=8, pin_memory=False)
    pool.commit(pool.allocate(hashes))
    return pool


@pytest.mark.parametrize(("capacity", "stored", "pinned", "new", "held", "dropped", "evicted"), [
    # room for everything
    (4, [1, 2], [], [3], [1, 2, 3], 0, 0),
    # full: the least recently used entry (1) makes room
    (2, [1, 2], [], [3], [2, 3], 0, 1),
    # full, the oldest pinned by a load: the next oldest goes
    (3, [1, 2, 3], [1], [4], [1, 3, 4], 0, 1),
    # full and every entry pinned: the store is dropped, nothing lost
    (2, [1, 2], [1, 2], [3], [1, 2], 1, 0),
    # a held hash is touched, not stored twice
    (2, [1, 2], [], [1, 3], [1, 3], 0, 1),
])
def test_allocate_evicts_lru_unpinned_or_drops(capacity, stored, pinned, new, held, dropped,
                                              evicted):
    pool = filled(capacity, stored)
    pool.pin(pinned)
    pool.commit(pool.allocate(new))
    assert [h for h in range(1, 6) if h in pool] == held
    assert (pool.stats.dropped, pool.stats.evicted) == (dropped, evicted)


def test_unpin_makes_entries_evictable_again():
    pool = filled(1, [1])
    rows = pool.pin([1])
    assert pool.allocate([2]) == []
    pool.unpin(rows)
    assert [h for h, _ in pool.allocate([2])] == [2]


def test_pin_and_prefix_stop_at_the_first_miss():
    pool = filled(4, [1, 2, 4])
    assert pool.num_cached_prefix([1, 2, 3, 4]) == 2
    assert len(pool.pin([1, 2, 3, 4])) == 2


def test_discard_frees_the_row_and_commit_keeps_the_first_copy():
    pool = filled(2, [1])
    pool.discard([1])
    assert 1 not in pool and pool.usage == 0.0
    first, second = pool.allocate([5]), pool.allocate([5])
    pool.commit(first)
    pool.commit(second)  # the same hash written twice meanwhile: one entry, one row back
    assert pool.usage == 0.5
    assert len(pool.allocate([6])) == 1  # the duplicate's row was given back


def test_events_say_what_was_stored_and_evicted_in_order():
    pool = filled(1, [1])
    pool.commit(pool.allocate([2]))
    assert pool.take_events() == [(True, 1), (False, 1), (True, 2)]
    assert pool.take_events() == []


def test_a_pool_without_room_for_one_block_names_the_flag():
    with pytest.raises(ValueError, match="kv-offload-gb"):
        HostKVPool(0, block_bytes=8, pin_memory=False)


def test_consecutive_rows_move_as_runs():
    """The GPU load copies each run of side-by-side host rows at once: runs cover every row in
    order, and a gap or a step back starts a new run."""
    from kvpilot.engine.kv_connector.host_tier import consecutive_runs

    rows = [7, 8, 9, 3, 4, 10, 10, 11]
    runs = consecutive_runs(rows)
    assert runs == [(0, 7, 3), (3, 3, 2), (5, 10, 1), (6, 10, 2)]
    assert [row for _, first, count in runs for row in range(first, first + count)] == rows
    assert consecutive_runs([]) == []
