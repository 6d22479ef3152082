"""What a re-read manifest changes: the field that forbids a reload, and the processes to add or drop.

Pure functions: `kvpilot up` re-plans the edited manifest with `plan_local` and
diffs that plan against the engines it runs. Only pool replica counts may change
while the fleet runs; anything else needs a restart.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.local.plan import LocalProcess

# The manifest fields a reload may change: each pool's replica count.
RELOADABLE = (("spec", "decode", "replicas"), ("spec", "prefill", "replicas"))


@dataclass
class ScaleActions:
    """Engines to start, and how many replicas each pool (Deployment name) loses."""

    start: list[LocalProcess] = field(default_factory=list)
    stop: dict[str, int] = field(default_factory=dict)


def _without_replicas(manifest: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(manifest)
    for *parents, leaf in RELOADABLE:
        node: Any = out
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def _first_difference(old: Any, new: Any, path: str) -> str | None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in old or key not in new:
                return sub
            if (found := _first_difference(old[key], new[key], sub)) is not None:
                return found
        return None
    return None if old == new else (path or "(the whole manifest)")


def unreloadable_field(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Gives the dotted path of the first changed field other than a pool's replicas, or None."""
    return _first_difference(_without_replicas(old), _without_replicas(new), "")


def diff_plan(running: list[LocalProcess], planned: list[LocalProcess]) -> ScaleActions:
    """Gives what turns the running engines into the planned ones, pool by pool.

    A grown pool starts planned replicas whose names are not running (the plan's
    ports are fresh); a shrunk pool loses a count of replicas, which the caller
    picks by load (`removal_order`), since a plan cannot know the load.
    """
    actions = ScaleActions()
    pools = sorted({p.pool for p in running} | {p.pool for p in planned})
    for pool in pools:
        have = {p.name for p in running if p.pool == pool}
        want = [p for p in planned if p.pool == pool]
        if len(want) > len(have):
            actions.start += [p for p in want if p.name not in have][:len(want) - len(have)]
        elif len(want) < len(have):
            actions.stop[pool] = len(have) - len(want)
    return actions
