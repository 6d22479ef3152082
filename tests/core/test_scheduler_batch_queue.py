"""The scheduler under pipeline parallelism's batch queue: sequences of a batch in flight
(`busy`) are neither scheduled again nor preempted, and `max_seqs` splits the running
sequences into one batch per stage."""

from __future__ import annotations

from core_helpers import make_request, make_scheduler, run_step, scheduled_ids, seq_of

from kvpilot.engine.core.request import SequenceStatus


def test_busy_sequences_are_skipped_and_max_seqs_splits_the_batch():
    s = make_scheduler()
    requests = [make_request(f"r{i}", 3) for i in range(4)]
    for request in requests:
        s.add(seq_of(request))
    first = s.schedule(max_seqs=2)
    assert scheduled_ids(first) == [("r0", 3), ("r1", 3)]
    busy = {seq.seq_id for seq, _ in first.scheduled}
    assert scheduled_ids(s.schedule(busy, max_seqs=2)) == [("r2", 3), ("r3", 3)]
    # every sequence in flight now: nothing left to schedule
    busy |= {seq_of(r).seq_id for r in requests[2:]}
    assert s.schedule(busy, max_seqs=2).is_empty


def test_a_busy_sequence_is_never_the_preemption_victim():
    # 4 blocks of 4 slots: two 8-token prompts fill them; each decode then needs a fifth
    s = make_scheduler(num_blocks=4, block_size=4, caching=False)
    a, b = make_request("a", list(range(100, 108))), make_request("b", list(range(200, 208)))
    s.add(seq_of(a))
    s.add(seq_of(b))
    assert scheduled_ids(run_step(s)) == [("a", 8), ("b", 8)]
    # b (the less important) is in flight: a must give way itself, b keeps its blocks
    plan = s.schedule({seq_of(b).seq_id})
    assert plan.is_empty and plan.preempted == [seq_of(a)]
    assert seq_of(b).status is SequenceStatus.RUNNING
    assert seq_of(a).status is SequenceStatus.WAITING
