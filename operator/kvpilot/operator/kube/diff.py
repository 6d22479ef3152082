"""Pure comparisons of desired and stored objects: what `Kube.apply` patches, and what it leaves."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def differs(current: Any, desired: Any) -> bool:
    """Gives whether `current` lacks something `desired` asks for.

    Keys only `current` has (server defaults, other writers) do not count, also inside
    list items matched by position: a container the API server filled with defaults is
    still the container we rendered. A list of another length always differs.
    """
    if isinstance(desired, Mapping):
        if not isinstance(current, Mapping):
            return True
        return any(differs(current.get(k), v) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(current, list) or len(current) != len(desired):
            return True
        return any(differs(c, d) for c, d in zip(current, desired, strict=True))
    return current != desired


def without(obj: Mapping[str, Any], paths: Iterable[tuple[str, ...]]) -> dict[str, Any]:
    """Gives a copy of `obj` with the nested keys at `paths` removed."""
    out: dict[str, Any] = dict(obj)
    for path in paths:
        node = out
        for key in path[:-1]:
            if not isinstance(node.get(key), Mapping):
                break
            node[key] = dict(node[key])
            node = node[key]
        else:
            node.pop(path[-1], None)
    return out
