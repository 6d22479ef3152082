"""The host-memory tier (--kv-offload-gb) in a real tiny engine: a prefix evicted from the GPU
cache comes back from host memory with the same output; a corrupted block, a full tier and
a refused configuration end in recompute or a clear error."""

from __future__ import annotations

import pytest
from helpers.engine_run import run
from kv_tier_helpers import BLOCK, PROMPT, evict, host_pool, make_engine

from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.parallel.config import ParallelConfigError
from kvpilot.engine.server.metrics import ServerMetrics

OFFLOAD_GB = 0.001  # 1 MiB: 65 blocks of the tiny model, room for everything here


@pytest.fixture(scope="module")
def expected() -> list[int]:
    """PROMPT's greedy tokens from an engine that never evicts nor offloads."""
    return run(make_engine(), "ref", PROMPT)[0]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_evicted_prefix_is_restored_from_host_with_identical_output(expected, async_scheduling):
    engine = make_engine(OFFLOAD_GB, async_scheduling=async_scheduling)
    assert run(engine, "first", PROMPT)[0] == expected
    evict(engine, "x")
    hashes = hash_prompt_blocks(PROMPT, BLOCK)
    assert all(engine.kv.pool.lookup(h) is None for h in hashes)  # gone from the GPU
    before = engine.get_stats()
    tokens, final = run(engine, "again", PROMPT)
    after = engine.get_stats()
    assert tokens == expected
    assert after.kv_offload_loaded_blocks - before.kv_offload_loaded_blocks == 6
    assert after.external_prefix_cache_hits - before.external_prefix_cache_hits == 6 * BLOCK
    assert after.prompt_tokens - before.prompt_tokens == len(PROMPT) - 6 * BLOCK  # the tail only
    assert final.num_cached_tokens == 6 * BLOCK
    assert after.kv_offload_saved_blocks >= 6 and after.kv_offload_failed_blocks == 0


def test_without_a_host_tier_the_evicted_prefix_is_recomputed(expected):
    engine = make_engine()
    run(engine, "first", PROMPT)
    evict(engine, "x")
    before = engine.get_stats()
    assert run(engine, "again", PROMPT)[0] == expected
    assert engine.get_stats().prompt_tokens - before.prompt_tokens == len(PROMPT)


def test_a_corrupted_host_block_is_recomputed_not_read(expected):
    engine = make_engine(OFFLOAD_GB)
    run(engine, "first", PROMPT)
    evict(engine, "x")
    pool = host_pool(engine)
    third = hash_prompt_blocks(PROMPT, BLOCK)[2]
    (row,) = pool.pin([third])
    pool.unpin([row])
    pool.data[row, :64] ^= 0x5A  # a few flipped bytes in host memory
    before = engine.get_stats()
    tokens, final = run(engine, "again", PROMPT)
    after = engine.get_stats()
    assert tokens == expected
    assert after.kv_offload_failed_blocks - before.kv_offload_failed_blocks == 1
    assert after.kv_offload_loaded_blocks == before.kv_offload_loaded_blocks
    assert after.prompt_tokens - before.prompt_tokens == len(PROMPT)  # all of it recomputed
    assert final.num_cached_tokens == 0
    assert third not in pool  # the broken entry is gone, not offered again


def test_a_full_host_tier_keeps_the_newest_blocks_and_recomputes_the_rest(expected):
    probe = make_engine(OFFLOAD_GB)
    block_bytes = host_pool(probe).block_bytes
    engine = make_engine(4 * block_bytes / 2**30)  # room for 4 blocks
    assert host_pool(engine).num_blocks == 4
    run(engine, "first", PROMPT)
    evict(engine, "x")  # 6 prompt blocks and the fillers' pass through 4 rows
    before = engine.get_stats()
    assert before.kv_offload_evicted_blocks > 0 and before.kv_host_cache_usage == 1.0
    assert run(engine, "again", PROMPT)[0] == expected
    assert engine.get_stats().kv_offload_loaded_blocks == before.kv_offload_loaded_blocks


def test_host_tier_changes_are_kv_events_and_metrics():
    engine = make_engine(OFFLOAD_GB)
    run(engine, "first", PROMPT)
    evict(engine, "x")
    run(engine, "again", PROMPT)
    events = engine.kv_events.read(0)["events"]
    host_stored = [h for e in events if e.get("tier") == "host" for h in e.get("stored", [])]
    assert set(hash_prompt_blocks(PROMPT, BLOCK)) <= set(host_stored)
    assert all("tier" not in e for e in events if "cleared" in e)
    metrics = ServerMetrics("tiny")
    metrics.set_stats(engine.get_stats())
    text = metrics.render().decode()
    assert f'vllm:external_prefix_cache_hits_total{{model_name="tiny"}} {6 * BLOCK}.0' in text
    assert 'kvpilot_kv_offload_blocks_total{model_name="tiny",op="loaded"} 6.0' in text
    assert 'kvpilot_kv_host_cache_usage_perc{model_name="tiny"}' in text


@pytest.mark.parametrize(("overrides", "error", "match"), [
    ({"kv_offload_gb": -1.0}, ValueError, "kv_offload_gb=-1.0 is invalid"),
    ({"kv_offload_gb": 0.001, "enable_prefix_caching": False}, ValueError,
     "needs prefix caching"),
    ({"kv_offload_gb": 0.001, "tensor_parallel_size": 2}, ParallelConfigError,
     "--kv-offload-gb=0.001 with 2 ranks"),
])
def test_unsupported_host_tier_setups_are_refused_by_name(overrides, error, match):
    with pytest.raises(error, match=match):
        make_engine(**overrides)
