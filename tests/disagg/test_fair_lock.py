"""The store's lock lets a waiting KV agent in between two engine steps.

The engine thread releases and retakes the lock once per step. With a plain
`threading.RLock` the releasing thread usually wins the race to retake it and a
waiting agent starves (on a GPU, long prompts' pulls timed out this way).
"""

from __future__ import annotations

import threading
import time

import pytest

from kvpilot.engine.kv_transfer.fair_lock import FairLock

STEP_S = 0.002
AGENT_ACQUIRES = 15


def steps_waited(lock) -> list[int]:
    """Gives, per agent acquisition, how many engine steps ran while the agent waited."""
    steps = [0]
    stop = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            # steps re-enter it (a prefill engine offers blocks inside a step)
            with lock, lock:
                steps[0] += 1
                busy_until = time.perf_counter() + STEP_S
                while time.perf_counter() < busy_until:  # Python work, holding the GIL
                    pass

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    waited = []
    try:
        deadline = time.monotonic() + 30  # a bound for a loaded machine; ~0.1 s here
        while len(waited) < AGENT_ACQUIRES and time.monotonic() < deadline:
            time.sleep(STEP_S * 1.5)
            before = steps[0]
            with lock:
                waited.append(steps[0] - before)
    finally:
        stop.set()
        thread.join(5)
    return waited


def test_a_waiting_agent_gets_the_lock_after_at_most_one_step():
    waited = steps_waited(FairLock())
    assert len(waited) == AGENT_ACQUIRES
    assert max(waited) <= 1


def test_fair_lock_is_reentrant_and_checks_its_owner():
    lock = FairLock()
    with lock, lock:
        pass
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()
