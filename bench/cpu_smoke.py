"""What the benchmark scripts' CPU smoke runs share: one torch thread per process."""

from __future__ import annotations

import os
import sys


def one_thread_per_process() -> None:
    """Sets this process, and every process it starts after, to one torch intra-op thread.

    A smoke run checks a script, it measures nothing, and it runs beside other processes
    on small CI boxes: there OpenMP's threads wait on each other's preempted cores, and one
    129-token attention call took 90 ms instead of 0.6 ms (2 cores, load 5). A value the
    caller already set (OMP_NUM_THREADS) is kept.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read by each child's torch at its start
    torch = sys.modules.get("torch")  # imported already: its pool may be sized; else unloaded
    if torch is not None:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
