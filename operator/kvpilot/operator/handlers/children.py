"""Applying rendered children by server-side apply, and removing the ones a spec no longer renders.

Create-only children (the fleet Secret) are the exception: server-side apply is a PATCH, and
a PATCH would both need and use the right to overwrite any Secret of the namespace. They are
created (a POST under kvpilot's field manager, so `managedFields` name kvpilot) when absent
and left as they are when present (409): never read, never changed, never listed for
pruning; their owner reference deletes them with their owner.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.handlers.events import record
from kvpilot.operator.kube.client import Kube
from kvpilot.operator.kube.diff import without
from kvpilot.operator.kube.errors import Conflict, FieldConflict, KubeError
from kvpilot.operator.ownership import (
    HANDOVER_MANAGER,
    REPLICAS,
    PoolApply,
    conflict_message,
    foreign,
)

logger = logging.getLogger(__name__)
Key = tuple[str, str]
"""(kind, name) of a child."""


@dataclass
class Applied:
    """What one reconcile's applies did: changes for the event, the stored objects, drift."""

    changes: list[str] = field(default_factory=list)
    """'Kind/name created|changed|deleted' per change."""
    stored: list[dict[str, Any]] = field(default_factory=list)
    """The applied objects as the server now holds them, in order."""
    conflicts: dict[Key, list[Conflict]] = field(default_factory=dict)
    """Fields other writers had taken from kvpilot, which it took back, by child."""


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Gives whether `obj` carries an owner reference to the object with `uid`."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid for ref in refs)


def field_conflicts(conflicts: Mapping[Key, list[Conflict]]) -> list[dict[str, str]]:
    """Gives `status.fieldConflicts`: one entry per field kvpilot took back in this reconcile."""
    return [{"object": f"{kind}/{name}", "field": c.field, "manager": c.manager}
            for (kind, name), found in sorted(conflicts.items()) for c in found]


async def hand_over(kube: Kube, body: Mapping[str, Any]) -> None:
    """Applies the replicas handover; a conflict means another writer owns replicas already."""
    try:
        await kube.apply(body, manager=HANDOVER_MANAGER)
    except FieldConflict as exc:
        logger.debug("replicas of %s stay with %s", body["metadata"]["name"],
                     [c.manager for c in exc.conflicts])


async def apply_owned(kube: Kube, obj: Mapping[str, Any], applied: Applied,
                      before: Mapping[Key, Mapping[str, Any]] | None,
                      yield_replicas: bool = False) -> None:
    """Applies `obj` as kvpilot, forcing back fields another writer changed (noted as drift);
    `before` holds the children as listed before this reconcile (None: not listed).

    With `yield_replicas` (a pool whose replicas an autoscaler owns, applied as if new), a
    conflict on spec.replicas means the pool existed after all: replicas are left out.
    """
    key = (obj["kind"], obj["metadata"]["name"])
    try:
        created, stored = await kube.apply(obj)
    except FieldConflict as exc:
        if yield_replicas and any(c.field == ".spec.replicas" for c in exc.conflicts):
            obj = without(obj, [REPLICAS])
        created, stored = await kube.apply(obj, force=True)
        if drift := foreign(exc.conflicts):
            applied.conflicts[key] = drift
    applied.stored.append(stored)
    old = (before or {}).get(key)
    if created:
        applied.changes.append(f"{key[0]}/{key[1]} created")
    elif old is not None and old["metadata"].get("resourceVersion") != \
            stored["metadata"].get("resourceVersion"):
        applied.changes.append(f"{key[0]}/{key[1]} changed")


async def create_once(kube: Kube, obj: Mapping[str, Any], applied: Applied) -> None:
    """Creates `obj` unless an object of its name exists (which is left untouched)."""
    try:
        await kube.create(obj)
    except KubeError as exc:
        if exc.status == 409:
            return
        raise
    applied.changes.append(f"{obj['kind']}/{obj['metadata']['name']} created")


async def listed(kube: Kube, kinds: Iterable[tuple[str, str]], namespace: str,
                 labels: Mapping[str, str]) -> dict[Key, tuple[str, dict[str, Any]]]:
    """Gives the objects of `kinds` with `labels`: {(kind, name): (apiVersion, object)}."""
    out: dict[Key, tuple[str, dict[str, Any]]] = {}
    for api_version, kind in kinds:
        for obj in await kube.list(api_version, kind, namespace, labels):
            out[(kind, obj["metadata"]["name"])] = (api_version, obj)
    return out


async def sync_children(kube: Kube, owner: Mapping[str, Any], objects: Sequence[Mapping[str, Any]],
                        kinds: Iterable[tuple[str, str]], labels: Mapping[str, str], *,
                        prune_stale: bool,
                        pools: Mapping[str, PoolApply] | None = None,
                        create_only: Sequence[Mapping[str, Any]] = ()) -> Applied:
    """Gives what applying `objects` did, after deleting `owner`'s children of `kinds` it no longer
    renders (when `prune_stale`: the current children are listed first) and posting one
    Reconciled event listing the changes and one FieldConflict warning per child that drifted.

    `pools` replaces the body of the named pools and adds their replicas handover;
    `create_only` objects are created first when absent, never applied. API errors
    propagate: the caller decides between retrying and rejecting.
    """
    meta = owner["metadata"]
    current = await listed(kube, kinds, meta["namespace"], labels) if prune_stale else None
    before = {key: obj for key, (_, obj) in current.items()} if current is not None else None
    applied = Applied()
    for obj in create_only:  # before the pods that mount them
        await create_once(kube, obj, applied)
    for obj in objects:
        plan = (pools or {}).get(obj["metadata"]["name"]) if obj["kind"].endswith("Pool") else None
        handover = plan.handover if plan is not None else None
        creating = plan is not None and not plan.handover_first
        if handover is not None and not creating:
            await hand_over(kube, handover)
        await apply_owned(kube, plan.body if plan is not None else obj, applied, before,
                          yield_replicas=handover is not None and creating)
        if handover is not None and creating:
            await hand_over(kube, handover)
    wanted = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for (kind, name), (api_version, obj) in (current or {}).items():
        if (kind, name) not in wanted and owned_by(obj, meta["uid"]) and \
                await kube.delete(api_version, kind, meta["namespace"], name):
            applied.changes.append(f"{kind}/{name} deleted")
    if applied.changes:
        await record(kube, owner, "Reconciled", "; ".join(applied.changes))
    for (kind, name), drift in applied.conflicts.items():
        await record(kube, owner, "FieldConflict", conflict_message(kind, name, drift),
                     warning=True)
    return applied
