"""Scheduler tables: budget split, decodes first, preemption victims, never-fits rejection."""

from __future__ import annotations

import pytest
from core_helpers import make_request, make_scheduler, run_step, scheduled_ids, seq_of


def _admit(scheduler, *requests):
    for request in requests:
        scheduler.add(seq_of(request))


@pytest.mark.parametrize(("budget", "chunked", "prompt", "expected"), [
    # two decodes take 1 token each; the new prompt gets what is left
    (10, True, 20, [("a", 1), ("b", 1), ("c", 8)]),
    (100, True, 20, [("a", 1), ("b", 1), ("c", 20)]),
    # without chunking a prompt waits for a step with room for all of it
    (10, False, 9, [("a", 1), ("b", 1)]),
    (22, False, 20, [("a", 1), ("b", 1), ("c", 20)]),
    # a budget of one still serves a decode first
    (1, True, 20, [("a", 1)]),
])
def test_budget_split(budget, chunked, prompt, expected):
    s = make_scheduler(max_num_batched_tokens=100, enable_chunked_prefill=chunked)
    a, b = make_request("a", 3), make_request("b", 5)
    _admit(s, a, b)
    run_step(s)  # both prefills done: a and b are now decodes
    s.config.max_num_batched_tokens = budget
    _admit(s, make_request("c", list(range(200, 200 + prompt))))
    assert scheduled_ids(s.schedule()) == expected


def test_decodes_come_before_a_continuing_prefill():
    s = make_scheduler(max_num_batched_tokens=6)
    # `long` arrived first, so it is the more important one; its prefill still waits its turn
    long, short = make_request("long", list(range(200, 220))), make_request("short", 2)
    _admit(s, short)
    assert scheduled_ids(run_step(s)) == [("short", 2)]
    _admit(s, long)
    assert scheduled_ids(run_step(s)) == [("short", 1), ("long", 5)]
    assert scheduled_ids(run_step(s)) == [("short", 1), ("long", 5)]
    assert scheduled_ids(run_step(s)) == [("short", 1), ("long", 5)]


@pytest.mark.parametrize(("policy", "expected"), [
    # fcfs: the running prefill's next chunk first, taking the whole budget
    ("fcfs", [("decoding", 1), ("low", 11)]),
    # priority: the more important new prompt first, whole; the prefill takes what is left
    ("priority", [("decoding", 1), ("high", 6), ("low", 5)]),
])
def test_a_more_important_prompt_goes_before_a_running_prefills_next_chunk(policy, expected):
    s = make_scheduler(max_num_batched_tokens=12, policy=policy)
    _admit(s, make_request("decoding", 2, priority=0))
    run_step(s)
    _admit(s, make_request("low", list(range(200, 230)), priority=5))
    assert scheduled_ids(run_step(s)) == [("decoding", 1), ("low", 11)]
    _admit(s, make_request("high", list(range(300, 306)), priority=0))
    assert scheduled_ids(run_step(s)) == expected
    if policy == "priority":  # a newcomer less important than the running prefill waits
        _admit(s, make_request("lower", 4, priority=9))
        assert scheduled_ids(run_step(s)) == [("decoding", 1), ("high", 1), ("low", 10)]


def test_unchunked_recompute_longer_than_the_budget_still_runs():
    s = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False, caching=False)
    request = make_request("r", 6, max_tokens=8)
    _admit(s, request)
    run_step(s)
    run_step(s)
    run_step(s)  # 9 tokens now: more than the whole budget
    s._preempt(seq_of(request), type("Out", (), {"preempted": []})())
    assert scheduled_ids(s.schedule()) == [("r", 8)]


def test_max_num_seqs_caps_admission():
    s = make_scheduler(max_num_seqs=2)
    _admit(s, *(make_request(f"r{i}", 3) for i in range(4)))
    assert [rid for rid, _ in scheduled_ids(s.schedule())] == ["r0", "r1"]
    assert len(s.waiting) == 2


@pytest.mark.parametrize(("policy", "priorities", "victim"), [
    ("fcfs", [0, 0, 0], "r2"),  # newest arrival goes first
    ("fcfs", [0, 5, 0], "r2"),  # priority ignored under fcfs
    ("priority", [0, 5, 0], "r1"),  # lowest priority (largest value) first, though older
    ("priority", [3, 3, 1], "r1"),  # same priority: the newer one
])
def test_preemption_victim_order(policy, priorities, victim):
    # block_size 4, 6 blocks: three 7-token prompts take 2 blocks each; the next decode
    # (position 8) needs a third block for whoever computes first
    s = make_scheduler(num_blocks=6, block_size=4, policy=policy)
    requests = [make_request(f"r{i}", 7, max_tokens=8, priority=p)
                for i, p in enumerate(priorities)]
    _admit(s, *requests)
    run_step(s)  # prefills (7 tokens each) fill all six blocks... with room for position 7
    plan = run_step(s)  # decode at position 7 fits in block 1; append token -> 9 tokens
    assert not plan.preempted
    plan = run_step(s)
    assert [p.request.request_id for p in plan.preempted] == [victim]
    assert s.num_preemptions == 1
    preempted = seq_of(next(r for r in requests if r.request_id == victim))
    assert preempted.num_computed_tokens == 0
    assert preempted.num_output_tokens == 2  # generated tokens are kept for the recompute
    assert preempted in s.waiting


def test_preempted_request_resumes_and_everything_finishes():
    s = make_scheduler(num_blocks=6, block_size=4)
    requests = [make_request(f"r{i}", 7, max_tokens=8) for i in range(3)]
    _admit(s, *requests)
    for _ in range(60):
        if not s.num_unfinished:
            break
        run_step(s)
    assert s.num_unfinished == 0
    assert s.num_preemptions > 0
    assert all(seq_of(r).num_output_tokens == 8 for r in requests)
    assert s.kv.pool.num_free_blocks == 6


@pytest.mark.parametrize(("prompt", "max_tokens", "num_blocks", "chunked", "budget", "error"), [
    (10, 6, 64, True, 64, None),
    (10, 7, 64, True, 64, "max_model_len=16"),  # 17 tokens > max_model_len 16
    (10, 6, 3, True, 64, "needs 4 KV blocks"),  # 16 tokens = 4 blocks > pool of 3
    (10, 6, 64, False, 8, "max_num_batched_tokens=8"),  # unchunked prompt over the budget
    (10, 6, 64, True, 8, None),  # the same prompt in chunks is fine
])
def test_never_fits(prompt, max_tokens, num_blocks, chunked, budget, error):
    s = make_scheduler(num_blocks=num_blocks, block_size=4, max_model_len=16,
                       enable_chunked_prefill=chunked, max_num_batched_tokens=budget)
    reason = s.never_fits(make_request("r", prompt, max_tokens=max_tokens))
    if error is None:
        assert reason is None
    else:
        assert error in reason


def test_second_request_computes_only_past_a_shared_three_block_prefix():
    s = make_scheduler(block_size=4)
    prefix = list(range(100, 112))  # three full blocks
    first = make_request("first", [*prefix, 1, 2])
    _admit(s, first)
    run_step(s)
    second = make_request("second", [*prefix, 3, 4, 5])
    _admit(s, second)
    plan = s.schedule()
    assert ("second", 3) in scheduled_ids(plan)
    assert seq_of(second).num_computed_tokens == 12
    assert s.kv.prefix_cache_hits == 12
    assert s.kv.prefix_cache_queries == 14 + 15
    assert s.kv.block_ids(seq_of(second))[:3] == s.kv.block_ids(seq_of(first))[:3]


def test_a_fully_cached_prompt_still_computes_its_last_token():
    s = make_scheduler(block_size=4)
    prompt = list(range(100, 108))  # exactly two blocks
    first = make_request("a", prompt)
    _admit(s, first)
    run_step(s)
    again = make_request("b", prompt)
    _admit(s, again)
    plan = s.schedule()
    # only the last token is recomputed for the logits, in a copy of the cached last block
    assert ("b", 1) in scheduled_ids(plan)
    assert s.kv.prefix_cache_hits == 7
    cached_last = s.kv.pool.lookup(seq_of(first).block_hashes[1])
    assert plan.block_copies == [(cached_last.block_id, s.kv.block_ids(seq_of(again))[1])]


def test_an_idle_beam_yields_its_blocks_and_waits_for_selection():
    s = make_scheduler(num_blocks=4, block_size=4)
    beam = make_request("beam", 12)  # 3 blocks
    _admit(s, beam)
    s.schedule()
    idle = seq_of(beam)
    idle.num_computed_tokens = 12  # computed; its next token waits for its sibling beams
    idle.beam_candidates = [(-1.0, 5)]
    _admit(s, make_request("other", list(range(200, 208))))  # 2 blocks, 1 free
    plan = s.schedule()
    assert scheduled_ids(plan) == [("other", 8)]
    assert [p.request.request_id for p in plan.preempted] == ["beam"]
    assert idle in s.waiting and idle.beam_candidates == [(-1.0, 5)]
    # candidates ready: the preempted beam is not recomputed before selection
    assert scheduled_ids(run_step(s)) == [("other", 8)]
    assert scheduled_ids(s.schedule()) == [("other", 1)]
