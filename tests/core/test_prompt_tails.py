"""Partial last blocks of prompts: cached by a prefill engine, hit by the next admission.

A prefill engine (`cache_prompt_tails`) caches a finished prompt's partial last block
under `hash_prompt_tail`; a KV transfer carries it like any cached block. An engine
admitting the same prompt then hits every block and computes only the last token, in a
copy of the tail block (it writes that slot and the ones after), so the cached tail
stays as the prefill left it.
"""

from __future__ import annotations

from core_helpers import make_request, run_step, scheduled_ids, seq_of

from kvpilot.engine.contracts.block_hash import hash_prompt_blocks, hash_prompt_tail
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.scheduler import Scheduler, SchedulerConfig

PROMPT = list(range(100, 110))  # block size 4: two full blocks and a 2-token tail


def scheduler(cache_prompt_tails: bool) -> Scheduler:
    kv = KVCacheManager(32, 4, cache_prompt_tails=cache_prompt_tails)
    return Scheduler(SchedulerConfig(), kv)


def test_hash_prompt_tail():
    full = hash_prompt_blocks(PROMPT, 4)
    assert len(full) == 2 and hash_prompt_tail(PROMPT, 4, full) not in full
    assert hash_prompt_tail(PROMPT[:8], 4, full) is None  # ends on a block boundary


def test_prefill_engine_caches_the_tail_and_the_next_admission_computes_one_token():
    s = scheduler(cache_prompt_tails=True)
    s.add(seq_of(make_request("prefill", PROMPT, max_tokens=1)))
    run_step(s)  # computes the prompt, samples its one token, frees it
    tail = hash_prompt_tail(PROMPT, 4, hash_prompt_blocks(PROMPT, 4))
    cached = s.kv.pool.lookup(tail)
    assert cached is not None and cached.ref_cnt == 0
    again = make_request("decode", PROMPT)
    s.add(seq_of(again))
    plan = s.schedule()
    assert scheduled_ids(plan) == [("decode", 1)]
    assert again.num_cached_tokens == len(PROMPT) - 1
    own = s.kv.block_ids(seq_of(again))[2]
    assert plan.block_copies == [(cached.block_id, own)] and own != cached.block_id
    assert s.kv.pool.lookup(tail) is cached and cached.ref_cnt == 0  # left as it was


def test_engines_that_are_not_prefill_engines_cache_no_tails():
    s = scheduler(cache_prompt_tails=False)
    s.add(seq_of(make_request("a", PROMPT, max_tokens=1)))
    run_step(s)
    s.add(seq_of(make_request("b", PROMPT)))
    assert scheduled_ids(s.schedule()) == [("b", 2)]  # the tail is recomputed
