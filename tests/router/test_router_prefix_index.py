"""The prefix index: leading-block matches, LRU eviction and its hard cap."""

from __future__ import annotations

import time
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.engine.router.prefix_index import ENTRY_BYTES, PrefixIndex


@pytest.mark.parametrize(("held", "prompt", "expected"), [
    ([1, 2, 3], [1, 2, 3], 3),
    ([1, 2, 3], [1, 2, 3, 4, 5], 3),
    ([1, 2, 3], [1, 2], 2),
    ([1, 3], [1, 2, 3], 1),  # a hole stops the match: later blocks need the earlier ones
    ([2, 3], [1, 2, 3], 0),
    ([], [1], 0),
    ([1], [], 0),
])
def test_match_counts_leading_blocks(held, prompt, expected):
    index = PrefixIndex(100)
    index.insert("a", held)
    assert index.match("a", prompt) == expected
    assert index.match("b", prompt) == 0


def test_lru_evicts_the_least_recently_used_pair():
    index = PrefixIndex(3)
    index.insert("a", [1, 2, 3])
    assert index.match("a", [1]) == 1  # touches (a, 1): now (a, 2) is the oldest
    index.insert("b", [9])
    assert (index.match("a", [1]), index.match("a", [1, 2]), index.match("b", [9])) == (1, 1, 1)
    assert len(index) == 3 and index.evictions == 1


def test_remove_and_remove_instance():
    index = PrefixIndex(10)
    index.insert("a", [1, 2])
    index.insert("b", [1, 2])
    index.remove("a", [2, 77])
    assert (index.match("a", [1, 2]), index.match("b", [1, 2])) == (1, 2)
    index.remove_instance("b")
    assert index.match("b", [1]) == 0 and len(index) == 1


def test_size_per_instance_follows_inserts_evictions_and_removals():
    index = PrefixIndex(4)
    index.insert("a", [1, 2, 3])
    index.insert("b", [1])
    assert (index.size("a"), index.size("b")) == (3, 1)
    index.insert("b", [2])  # evicts (a, 1)
    assert (index.size("a"), index.size("b")) == (2, 2)
    index.remove("a", [2, 99])
    index.remove_instance("b")
    assert (index.size("a"), index.size("b"), len(index)) == (1, 0, 1)


def test_invalid_cap():
    with pytest.raises(ValueError, match="max_entries=0 is invalid"):
        PrefixIndex(0)


def test_a_million_distinct_prefixes_stay_under_the_cap():
    cap = 50_000
    index = PrefixIndex(cap)
    start = time.monotonic()
    for i in range(0, 1_000_000, 4):  # 250k prompts of 4 distinct blocks each
        index.insert(f"http://{i % 4}", (i, i + 1, i + 2, i + 3))
        assert len(index) <= cap or pytest.fail(f"{len(index)} entries > cap {cap}")
    assert len(index) == cap
    assert index.evictions == 1_000_000 - cap
    assert time.monotonic() - start < 20


def test_entry_bytes_bounds_the_real_memory():
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(20_000)
    for i in range(40_000):
        index.insert("http://10.0.0.1:8000", [2**63 + i])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert used <= len(index) * ENTRY_BYTES, used / len(index)


@given(st.integers(1, 20), st.lists(st.tuples(st.sampled_from("abc"),
                                              st.lists(st.integers(0, 30), max_size=6)),
                                    max_size=40))
def test_never_above_the_cap(cap, inserts):
    index = PrefixIndex(cap)
    for instance, hashes in inserts:
        index.insert(instance, hashes)
        assert len(index) <= cap
        assert sum(index.size(i) for i in "abc") == len(index)
    # the most recently inserted entries (up to the cap) are still there
    if inserts:
        instance, hashes = inserts[-1]
        newest = list(dict.fromkeys(reversed(hashes)))[:cap]
        assert all(index.match(instance, [h]) == 1 for h in newest)
