"""An InferenceModel's GPU budget shared by its pools: who gets the GPUs when it binds.

Each pool brings its policy's wish (`desired`) and its load in replicas-at-target
(`load`: a pool at 1.3× its target on 4 replicas carries 5.2). When the wishes
fit the budget they stand. When they do not, every pool keeps what it has (never
below minReplicas) and the free GPUs go one replica at a time to the pool whose
load per replica would be highest, i.e. where the SLO shortfall is largest. A
budget lowered below what the pools hold takes replicas back from the pools that
would suffer least.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolDemand:
    """One pool's side of the budget."""

    name: str
    current: int
    desired: int
    min_replicas: int = 0
    gpus_per_replica: int = 1
    load: float = 0.0
    """Replicas the pool needs to sit exactly at its targets."""


@dataclass(frozen=True)
class Allocation:
    """Replicas per pool within the budget, and whether (and how) the budget bound."""

    replicas: dict[str, int]
    binds: bool
    message: str


def _pressure(p: PoolDemand, replicas: int) -> float:
    return float("inf") if replicas <= 0 else p.load / replicas


def allocate(budget_gpus: int, pools: Sequence[PoolDemand]) -> Allocation:
    """Gives each pool's replicas so that their GPUs stay within `budget_gpus`."""
    def used(n: dict[str, int]) -> int:
        return sum(n[p.name] * p.gpus_per_replica for p in pools)

    wanted = {p.name: p.desired for p in pools}
    if used(wanted) <= budget_gpus:
        return Allocation(wanted, False, f"GPU budget {budget_gpus}: {used(wanted)} in use")

    n = {p.name: max(min(p.desired, p.current), p.min_replicas) for p in pools}
    while used(n) > budget_gpus:
        shrinkable = [p for p in pools if n[p.name] > p.min_replicas]
        if not shrinkable:
            break
        victim = min(shrinkable, key=lambda p: (_pressure(p, n[p.name] - 1), p.name))
        n[victim.name] -= 1
    while True:
        room = budget_gpus - used(n)
        growable = [p for p in pools if n[p.name] < p.desired and p.gpus_per_replica <= room]
        if not growable:
            break
        winner = max(growable, key=lambda p: (_pressure(p, n[p.name]), p.name))
        n[winner.name] += 1

    short = [p for p in pools if n[p.name] < p.desired]
    parts = ", ".join(f"{p.name} {n[p.name]} of {p.desired} wanted" for p in pools)
    worst = max(pools, key=lambda p: _pressure(p, n[p.name]))
    message = (f"GPU budget {budget_gpus} binds: {parts}; largest shortfall "
               f"{worst.name} at {_pressure(worst, n[worst.name]):.2f}x its target")
    return Allocation(n, bool(short), message)
