"""Applying rendered children and removing the ones a new spec no longer renders."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvpilot.operator.handlers.events import record
from kvpilot.operator.kube.client import Kube


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Gives whether `obj` carries an owner reference to the object with `uid`."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid for ref in refs)


async def apply_all(kube: Kube, objects: Sequence[Mapping[str, Any]],
                    keep: Mapping[str, Iterable[tuple[str, ...]]] | None = None,
                    ) -> tuple[list[str], list[dict[str, Any]]]:
    """Applies objects in order; gives 'Kind/name created|patched' per change, and the objects
    as the server now holds them."""
    changes: list[str] = []
    current: list[dict[str, Any]] = []
    for obj in objects:
        kept = (keep or {}).get(obj["metadata"]["name"], ())
        outcome, stored = await kube.apply(obj, keep=kept)
        current.append(stored)
        if outcome != "unchanged":
            changes.append(f"{obj['kind']}/{obj['metadata']['name']} {outcome}")
    return changes, current


async def prune(kube: Kube, kinds: Iterable[tuple[str, str]], namespace: str,
                labels: Mapping[str, str], owner_uid: str,
                rendered: Sequence[Mapping[str, Any]]) -> list[str]:
    """Deletes owned objects of `kinds` that are not in `rendered`; gives 'Kind/name deleted'."""
    wanted = {(o["kind"], o["metadata"]["name"]) for o in rendered}
    deleted: list[str] = []
    for api_version, kind in kinds:
        for obj in await kube.list(api_version, kind, namespace, labels):
            name = obj["metadata"]["name"]
            if (kind, name) in wanted or not owned_by(obj, owner_uid):
                continue
            if await kube.delete(api_version, kind, namespace, name):
                deleted.append(f"{kind}/{name} deleted")
    return deleted


async def sync_children(kube: Kube, owner: Mapping[str, Any], objects: Sequence[Mapping[str, Any]],
                        kinds: Iterable[tuple[str, str]], labels: Mapping[str, str], *,
                        prune_stale: bool,
                        keep: Mapping[str, Iterable[tuple[str, ...]]] | None = None,
                        ) -> list[dict[str, Any]]:
    """Gives `objects` as the server holds them after applying them, deleting `owner`'s stale
    children of `kinds` (when `prune_stale`) and posting one Reconciled event listing the changes.

    API errors propagate: the caller decides between retrying and rejecting.
    """
    meta = owner["metadata"]
    changes, current = await apply_all(kube, objects, keep=keep)
    if prune_stale:
        changes += await prune(kube, kinds, meta["namespace"], labels, meta["uid"], objects)
    if changes:
        await record(kube, owner, "Reconciled", "; ".join(changes))
    return current
