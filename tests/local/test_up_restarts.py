"""`kvpilot up` restarts a process that died, with back-off as a Deployment's pods get
(before, one dead replica stopped the whole fleet)."""

from __future__ import annotations

import sys
import time

import pytest

from kvpilot.operator.local.plan import LocalProcess
from kvpilot.operator.local.restarts import (
    MAX_RESTART_DELAY_S,
    RESTART_DELAY_S,
    STEADY_S,
    Restart,
    schedule,
)
from kvpilot.operator.local.supervisor import Supervisor


@pytest.mark.parametrize(("previous", "ran_for", "expected"), [
    (None, 0.5, Restart(100 + RESTART_DELAY_S, RESTART_DELAY_S, 1)),
    (Restart(0, 1.0, 1), 0.5, Restart(102, 2.0, 2)),  # died again at once: twice as long
    (Restart(0, 8.0, 4), 3.0, Restart(116, 16.0, 5)),
    (Restart(0, 16.0, 5), 3.0, Restart(100 + MAX_RESTART_DELAY_S, MAX_RESTART_DELAY_S, 6)),
    (Restart(0, MAX_RESTART_DELAY_S, 6), 1.0,
     Restart(100 + MAX_RESTART_DELAY_S, MAX_RESTART_DELAY_S, 7)),
    (Restart(0, 16.0, 5), STEADY_S, Restart(100 + RESTART_DELAY_S, RESTART_DELAY_S, 6)),
])
def test_back_off_table(previous, ran_for, expected):
    assert schedule(previous, died_at=100, ran_for=ran_for) == expected


def wait_exited(supervisor: Supervisor) -> None:
    deadline = time.monotonic() + 30
    while any(popen.poll() is None for _, popen in supervisor.running):
        assert time.monotonic() < deadline, "the process did not exit"
        time.sleep(0.02)


def test_a_dying_process_is_restarted_after_its_back_off(tmp_path):
    counter = tmp_path / "starts"
    code = f"open({str(counter)!r}, 'a').write('x'); raise SystemExit(3)"
    crashing = LocalProcess("crashing-0", "both", [sys.executable, "-c", code])
    supervisor = Supervisor(tmp_path)
    supervisor.start(crashing)
    try:
        wait_exited(supervisor)
        now = time.monotonic()
        lines = supervisor.tend(now)
        assert len(lines) == 1 and "exited with code 3; restart #1 in 1s" in lines[0]
        assert supervisor.tend(now + RESTART_DELAY_S / 2) == []  # backing off
        assert supervisor.tend(now + RESTART_DELAY_S) == ["crashing-0 restarted (#1)"]
        wait_exited(supervisor)
        assert counter.read_text() == "xx"
        lines = supervisor.tend(time.monotonic())
        assert "restart #2 in 2s" in lines[0]  # it died at once again: doubled
        supervisor.retire(["crashing-0"], grace=1)  # a retired replica is not restarted
        assert supervisor.tend(time.monotonic() + 60) == []
    finally:
        supervisor.stop()
