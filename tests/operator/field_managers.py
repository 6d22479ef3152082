"""Server-side apply as the emulator does it: fields owned per manager, merging, conflicts, removal.

A field is a path of map keys. Lists are one field each (atomic), as CRD lists without
`x-kubernetes-list-type` are; a real API server merges keyed lists of built-in kinds
(containers, ports, env, ownerReferences ...) item by item, which this does not. Nor does it
know defaults: a field the server defaulted is owned by nobody here, as there. Ownership is
written to `metadata.managedFields` in the API server's FieldsV1 form (`f:` keys), from
which it is read back, so clients see what a server would show for maps and atomic lists.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Path = tuple[str, ...]
MISSING = object()
NOT_FIELDS = {("apiVersion",), ("kind",), *(("metadata", k) for k in (
    "name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
    "managedFields", "deletionTimestamp", "generateName"))}
"""Identity and server-set metadata: never owned, never removed."""


class Conflicts(Exception):
    """An apply would change fields other managers own: (field path, manager, subresource)."""

    def __init__(self, found: list[tuple[Path, str, str]]) -> None:
        super().__init__(found)
        self.found = found


@dataclass
class Entry:
    """One `managedFields` entry: a manager, its operation, and the fields it owns."""

    manager: str
    operation: str  # "Apply" or "Update"
    api_version: str
    subresource: str = ""
    fields: set[Path] = field(default_factory=set)
    time: str = ""
    """When its fields last changed ("": now)."""

    def to_json(self, now: str) -> dict[str, Any]:
        """Gives the entry as the API server writes it."""
        out = {"manager": self.manager, "operation": self.operation,
               "apiVersion": self.api_version, "time": self.time or now,
               "fieldsType": "FieldsV1",
               "fieldsV1": fields_v1(self.fields)}
        if self.subresource:
            out["subresource"] = self.subresource
        return out


def leaves(obj: Mapping[str, Any], prefix: Path = ()) -> dict[Path, Any]:
    """Gives {path: value} of every field of `obj`: map keys recursed, lists and scalars whole."""
    out: dict[Path, Any] = {}
    for key, value in obj.items():
        path = (*prefix, key)
        if path in NOT_FIELDS:
            continue
        if isinstance(value, Mapping) and value:
            out.update(leaves(value, path))
        else:
            out[path] = value
    return out


def fields_v1(paths: Iterable[Path]) -> dict[str, Any]:
    """Gives the FieldsV1 tree of `paths` ({"f:spec": {"f:replicas": {}}})."""
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


def paths_of(tree: Mapping[str, Any], prefix: Path = ()) -> set[Path]:
    """Gives the field paths a FieldsV1 tree owns (its leaves)."""
    out: set[Path] = set()
    for key, sub in tree.items():
        if not key.startswith("f:"):
            continue
        path = (*prefix, key[2:])
        out |= paths_of(sub, path) if sub else {path}
    return out


def entries(obj: Mapping[str, Any] | None) -> list[Entry]:
    """Gives the ownership entries stored in an object's metadata.managedFields."""
    return [Entry(e["manager"], e["operation"], e.get("apiVersion", ""), e.get("subresource", ""),
                  paths_of(e.get("fieldsV1") or {}), e.get("time", ""))
            for e in ((obj or {}).get("metadata") or {}).get("managedFields") or []]


def write(obj: dict[str, Any], found: list[Entry]) -> None:
    """Stores `found` (without empty entries) as the object's metadata.managedFields."""
    now = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    obj.setdefault("metadata", {})["managedFields"] = [e.to_json(now) for e in found if e.fields]


def _overlap(a: Path, b: Path) -> bool:
    return a[:len(b)] == b or b[:len(a)] == a


def _get(obj: Mapping[str, Any], path: Path) -> Any:
    node: Any = obj
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return MISSING
        node = node[key]
    return node


def _put(obj: dict[str, Any], path: Path, value: Any) -> None:
    node = obj
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = copy.deepcopy(value)


def _remove(obj: dict[str, Any], path: Path) -> None:
    parents = [obj]
    for key in path[:-1]:
        node = parents[-1].get(key)
        if not isinstance(node, dict):
            return
        parents.append(node)
    parents[-1].pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):  # drop maps the removal left empty
        if parents[depth]:
            break
        parents[depth - 1].pop(path[depth - 1], None)


def _changes(current: Any, value: Any) -> bool:
    # An empty map only asks for the map to exist: it does not clear what others put in it.
    if value == {} and isinstance(current, Mapping):
        return False
    return current != value


def apply(current: Mapping[str, Any] | None, applied: Mapping[str, Any], manager: str,
          force: bool) -> dict[str, Any]:
    """Gives the object after `manager` applies `applied` to `current` (None: it is created).

    Raises Conflicts when another manager owns a field `applied` sets to another value and
    `force` is off; with `force` those fields change owner. A field `manager` applied before
    and leaves out now is removed unless another manager owns it.
    """
    found = entries(current)
    mine = leaves(applied)
    others = [e for e in found if (e.manager, e.operation) != (manager, "Apply")]
    clashes = [(p, e) for e in others for p in mine
               if any(_overlap(p, q) for q in e.fields) and _changes(_get(current or {}, p), mine[p])]
    if clashes and not force:
        raise Conflicts([(p, e.manager, e.subresource) for p, e in clashes])
    for path, entry in clashes:
        entry.fields = {q for q in entry.fields if not _overlap(path, q)}
        entry.time = ""
    new = copy.deepcopy(dict(current or {}))
    new.update(apiVersion=applied.get("apiVersion"), kind=applied.get("kind"))
    for path, value in mine.items():
        if _changes(_get(new, path), value):
            _put(new, path, value)
    previous = next((e for e in found if (e.manager, e.operation) == (manager, "Apply")), None)
    for path in (previous.fields if previous else set()) - mine.keys():
        still_applied = any(m[:len(path)] == path for m in mine)  # e.g. a map now filled
        if not still_applied and not any(_overlap(path, q) for e in others for q in e.fields):
            _remove(new, path)
    for path, value in mine.items():  # an applied empty map stays, though its keys went
        if value == {} and _get(new, path) is MISSING:
            _put(new, path, {})
    own = Entry(manager, "Apply", applied.get("apiVersion", ""), fields=set(mine),
                time=previous.time if previous and previous.fields == set(mine) else "")
    write(new, [*others, own])
    return new


def update(before: Mapping[str, Any] | None, after: dict[str, Any], manager: str,
           subresource: str = "") -> None:
    """Records in `after` that `manager` wrote it over `before` (create, merge patch, /status,
    /scale): the fields it changed become its own and leave every other manager."""
    old, new = leaves(before or {}), leaves(after)
    changed = {p for p in new if old.get(p, MISSING) != new[p]}
    gone = {p for p in old if p not in new}
    found = entries(before)
    for entry in found:
        kept = {q for q in entry.fields if not any(_overlap(p, q) for p in changed | gone)}
        entry.time, entry.fields = (entry.time if kept == entry.fields else ""), kept
    mine = next((e for e in found if (e.manager, e.operation, e.subresource)
                 == (manager, "Update", subresource)), None)
    if mine is None:
        mine = Entry(manager, "Update", after.get("apiVersion", ""), subresource)
        found.append(mine)
    if not changed <= mine.fields:
        mine.fields |= changed
        mine.time = ""
    write(after, found)


def conflict_status(found: list[tuple[Path, str, str]], api_version: str) -> dict[str, Any]:
    """Gives the message and details of the 409 a real API server answers for `found`."""
    causes = []
    for path, manager, subresource in found:
        via = f' with subresource "{subresource}"' if subresource else ""
        causes.append({"reason": "FieldManagerConflict", "field": "." + ".".join(path),
                       "message": f'conflict with "{manager}"{via} using {api_version}'})
    listed = "\n".join(f"- {c['message']}: {c['field']}" for c in causes)
    return {"message": f"Apply failed with {len(causes)} conflict(s):\n{listed}",
            "details": {"causes": causes}}
