"""When `kvpilot up` restarts a process that died: back-off as a Deployment's pods get.

Pure. A process that dies soon after it started waits twice as long as last time before
its next start (CrashLoopBackOff), from RESTART_DELAY_S up to MAX_RESTART_DELAY_S; one
that had run STEADY_S or longer starts again after RESTART_DELAY_S.
"""

from __future__ import annotations

from dataclasses import dataclass

RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
STEADY_S = 60.0


@dataclass(frozen=True)
class Restart:
    """A scheduled restart: when it is due, the delay it waited, how many came before."""

    due: float
    delay: float
    count: int


def schedule(previous: Restart | None, died_at: float, ran_for: float) -> Restart:
    """Gives the restart of a process that died at `died_at` after running `ran_for` seconds,
    given its previous restart (None: it never restarted)."""
    if previous is None or ran_for >= STEADY_S:
        delay = RESTART_DELAY_S
    else:
        delay = min(previous.delay * 2, MAX_RESTART_DELAY_S)
    return Restart(died_at + delay, delay, (previous.count if previous else 0) + 1)
