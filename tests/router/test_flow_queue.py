"""Flow control's queue rules as tables: ordering, fairness, bounds and shedding order,
time-outs, disconnects (`kvpilot.engine.router.flow_queue`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.engine.router.flow_queue import FlowQueue, QueueLimits, Waiter, retry_after_s


def queue_of(arrivals: list[tuple[str, int]], **limits: float) -> tuple[FlowQueue, list[str]]:
    """Gives a queue fed (flow, priority) arrivals one second apart, and what it shed, each
    request named flow+index (A0, B1, ...)."""
    queue = FlowQueue(QueueLimits(**limits))  # type: ignore[arg-type]
    shed: list[str] = []
    for n, (flow, priority) in enumerate(arrivals):
        waiter = Waiter(flow, priority, float(n))
        waiter.name = f"{flow}{n}"  # type: ignore[attr-defined]
        shed += [w.name for w in queue.offer(waiter)]  # type: ignore[attr-defined]
    return queue, shed


def drained(queue: FlowQueue) -> list[str]:
    out = []
    while (waiter := queue.pop()) is not None:
        out.append(waiter.name)  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize(("arrivals", "order"), [
    # one flow, one band: first in, first out
    ([("A", 0), ("A", 0), ("A", 0)], ["A0", "A1", "A2"]),
    # a higher band leaves first, whenever it came
    ([("A", 0), ("A", 0), ("B", 5)], ["B2", "A0", "A1"]),
    ([("A", -1), ("B", 0), ("C", 9), ("D", 0)], ["C2", "B1", "D3", "A0"]),
    # fairness: flows of one band take turns, a flood waits behind itself
    ([("A", 0), ("A", 0), ("A", 0), ("B", 0), ("B", 0)], ["A0", "B3", "A1", "B4", "A2"]),
    ([("A", 0)] * 4 + [("B", 0), ("C", 0)], ["A0", "B4", "C5", "A1", "A2", "A3"]),
    # turns are per band: B's turn in band 0 is not spent by A in band 1
    ([("A", 1), ("A", 1), ("A", 0), ("B", 0)], ["A0", "A1", "A2", "B3"]),
])
def test_dispatch_order(arrivals, order):
    queue, shed = queue_of(arrivals)
    assert shed == []
    assert drained(queue) == order
    assert len(queue) == 0 and queue.bands == {}


def test_round_robin_continues_after_new_arrivals():
    """A flow that just had its turn goes behind the flows waiting, also ones that came later."""
    queue, _ = queue_of([("A", 0), ("A", 0), ("B", 0)])
    assert queue.pop().name == "A0"  # type: ignore[union-attr,attr-defined]
    late = Waiter("C", 0, 9.0)
    late.name = "C9"  # type: ignore[attr-defined]
    queue.offer(late)
    assert drained(queue) == ["B2", "A1", "C9"]


@pytest.mark.parametrize(("arrivals", "limits", "shed", "left"), [
    # a flow's own queue is full: its newest arrival is shed, other flows still queue
    ([("A", 0)] * 3 + [("B", 0)], {"max_queued_per_flow": 2}, ["A2"], ["A0", "B3", "A1"]),
    # the whole queue is full: an arrival of a higher band displaces the lowest band's
    # newest request, from its longest flow
    ([("A", 0), ("A", 0), ("B", 0), ("H", 5)], {"max_queued": 3, "max_queued_per_flow": 2},
     ["A1"], ["H3", "A0", "B2"]),
    # ... the lowest band goes first, even when a middle band is longer
    ([("M", 2), ("M", 2), ("L", 1), ("H", 5)], {"max_queued": 3, "max_queued_per_flow": 2},
     ["L2"], ["H3", "M0", "M1"]),
    # ... an arrival no higher than the lowest band is shed itself
    ([("A", 1), ("B", 1), ("C", 1), ("D", 0)], {"max_queued": 3, "max_queued_per_flow": 3},
     ["D3"], ["A0", "B1", "C2"]),
    ([("A", 1), ("B", 1), ("C", 1), ("D", 1)], {"max_queued": 3, "max_queued_per_flow": 3},
     ["D3"], ["A0", "B1", "C2"]),
    # a flood of the low band under a full queue: every high arrival gets in, lows go
    ([("A", 0)] * 3 + [("H", 9)] * 3, {"max_queued": 3, "max_queued_per_flow": 3},
     ["A2", "A1", "A0"], ["H3", "H4", "H5"]),
])
def test_shedding_order(arrivals, limits, shed, left):
    queue, got = queue_of(arrivals, **limits)
    assert got == shed
    assert drained(queue) == left


@pytest.mark.parametrize(("timeout", "now", "expired", "left"), [
    (10.0, 9.5, [], ["A0", "B1", "A2"]),
    # arrived at 0: its deadline is 10; flow A keeps its turn (it was not served)
    (10.0, 10.0, ["A0"], ["A2", "B1"]),
    (10.0, 11.5, ["A0", "B1"], ["A2"]),
    (1.0, 99.0, ["A0", "A2", "B1"], []),
])
def test_time_out(timeout, now, expired, left):
    queue, _ = queue_of([("A", 0), ("B", 0), ("A", 0)], queue_timeout_s=timeout)
    assert queue.next_deadline() == timeout
    assert sorted(w.name for w in queue.expire(now)) == sorted(expired)  # type: ignore[attr-defined]
    assert drained(queue) == left


def test_disconnect_removes_the_request_wherever_it_waits():
    queue, _ = queue_of([("A", 0), ("B", 0), ("A", 0), ("C", 3)])
    by_name = {w.name: w for w in queue}  # type: ignore[attr-defined]
    assert queue.remove(by_name["A0"]) is True
    assert queue.remove(by_name["C3"]) is True  # its band empties and goes
    assert queue.remove(by_name["C3"]) is False  # gone already: nothing else is touched
    assert len(queue) == 2 and 3 not in queue.bands
    assert drained(queue) == ["A2", "B1"]  # A was not served: its turn stands


def test_pop_passes_over_an_ineligible_head_keeping_its_turn():
    """A flow whose head no replica can serve yet (its SLO) does not block the others, and
    is first once it can."""
    queue, _ = queue_of([("A", 0), ("B", 0), ("B", 0)])
    waiting = {w.name: w for w in queue}  # type: ignore[attr-defined]
    assert queue.pop(lambda w: w is not waiting["A0"]).name == "B1"  # type: ignore[union-attr,attr-defined]
    assert drained(queue) == ["A0", "B2"]
    assert queue.pop(lambda w: False) is None


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_queued_per_flow": 0}, "max_queued_per_flow"),
    ({"max_queued": 0, "max_queued_per_flow": 0}, "max_queued_per_flow"),
    ({"max_queued": 2, "max_queued_per_flow": 3}, "max_queued_per_flow"),
    ({"queue_timeout_s": 0}, "queue_timeout_s"),
])
def test_limits_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        QueueLimits(**kwargs)


@pytest.mark.parametrize(("queued", "rate", "seconds"), [
    (0, 5.0, 1), (10, 5.0, 2), (11, 5.0, 3), (1000, 1.0, 60), (5, 0.0, 60),
])
def test_retry_after(queued, rate, seconds):
    assert retry_after_s(queued, rate) == seconds


@given(st.lists(st.tuples(st.sampled_from("ABC"), st.integers(-2, 2), st.booleans()),
                max_size=60))
def test_bounds_and_accounting_hold(ops):
    """Whatever arrives and leaves: every request is queued, shed or popped exactly once,
    no flow holds more than its bound and the queue never more than its own."""
    limits = QueueLimits(max_queued_per_flow=3, max_queued=5)
    queue = FlowQueue(limits)
    offered, out = 0, 0
    for n, (flow, priority, pop) in enumerate(ops):
        if pop:
            out += queue.pop() is not None
        else:
            offered += 1
            out += len(queue.offer(Waiter(flow, priority, float(n))))
        assert len(queue) == sum(1 for _ in queue) <= limits.max_queued
        assert all(len(w) <= limits.max_queued_per_flow for band in queue.bands.values()
                   for w in band.flows.values())
        assert all(band.size == sum(len(w) for w in band.flows.values()) > 0
                   for band in queue.bands.values())
    assert offered == out + len(queue)
