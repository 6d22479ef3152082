"""Routing decisions as pure functions of what the router knows about each instance.

`round-robin` rotates; `least-load` takes the instance with the fewest waiting
plus in-flight requests (then the lowest KV usage); `prefix-aware` scores each
instance by the fraction of the prompt's blocks it probably holds minus a load
cost, a KV-usage cost and a small cost for how much it caches already, so a
request goes where its prefix is cached unless that instance is clearly busier,
and a new prefix goes to the idle instance that caches the least.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceView:
    """One instance's load as the router sees it when deciding."""

    url: str
    waiting: float = 0.0  # scraped vllm:num_requests_waiting
    in_flight: int = 0  # requests the router has open on it right now
    kv_usage: float = 0.0  # scraped vllm:kv_cache_usage_perc, 0..1
    cached_blocks: int = 0  # blocks the prefix index believes it holds

    @property
    def load(self) -> float:
        return self.waiting + self.in_flight


@dataclass(frozen=True)
class Weights:
    """Costs the prefix-aware score subtracts from the hit fraction."""

    load: float = 0.5
    kv_usage: float = 0.25
    # Small on purpose: only decides between instances with about equal hits and load, so a
    # new prefix goes where it evicts the least (SGLang's "smallest tree" rule).
    cached: float = 0.05
    # what a block found only in an instance's host-memory tier is worth against one in its
    # GPU cache (1) and a miss (0): loading it back is cheaper than computing it, not free
    host_hit: float = 0.5


def hit_blocks(gpu: int, host: int, weights: Weights) -> float:
    """Gives the prompt blocks an instance holds, a host-tier block counted `host_hit`."""
    return gpu + weights.host_hit * host


def score(view: InstanceView, hits: float, num_blocks: int, max_load: float,
          weights: Weights, max_cached: int = 0) -> float:
    """Gives the prefix-aware score: hit fraction (`hit_blocks`) minus relative load,
    KV-usage and cached-data costs."""
    hit = hits / num_blocks if num_blocks else 0.0
    relative_load = view.load / (max_load + 1.0)
    relative_cached = view.cached_blocks / (max_cached + 1.0)
    return (hit - weights.load * relative_load - weights.kv_usage * view.kv_usage
            - weights.cached * relative_cached)


def choose(policy: str, views: Sequence[InstanceView], *, counter: int = 0,
           hits: Mapping[str, float] | None = None, num_blocks: int = 0,
           weights: Weights = Weights()) -> InstanceView:
    """Gives the instance `policy` picks; `counter` rotates round-robin and breaks ties."""
    if not views:
        raise ValueError("no instance to choose from")
    n = len(views)
    # Rotating the candidate order by `counter` makes ties fall on different
    # instances in turn instead of always the first.
    rotated = [views[(counter + i) % n] for i in range(n)]
    if policy == "round-robin":
        return rotated[0]
    if policy == "least-load":
        return min(rotated, key=lambda v: (v.load, v.kv_usage))
    if policy == "prefix-aware":
        hits = hits or {}
        max_load = max(v.load for v in views)
        max_cached = max(v.cached_blocks for v in views)
        return max(rotated, key=lambda v: score(v, hits.get(v.url, 0), num_blocks, max_load,
                                                 weights, max_cached))
    raise ValueError(f"policy={policy!r} is invalid: choose round-robin, least-load or "
                     "prefix-aware")
