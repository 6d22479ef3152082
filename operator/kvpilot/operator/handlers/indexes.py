"""kopf indexes over the watched kvpilot objects, so handlers read them without API calls.

kopf updates an index from the watch stream before it runs handlers for the
same event, so an object's own handler always sees it; a handler that reads
another object's entry falls back to a GET when that object is not indexed yet.
The index functions are async only to skip kopf's thread hop for sync handlers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kopf

from kvpilot.operator.render.meta import GROUP_VERSION

GROUP, VERSION = GROUP_VERSION.split("/")


def snapshot(body: kopf.Body) -> dict[str, Any]:
    """Gives the parts of an object the handlers read (shares kopf's dicts; never mutate)."""
    meta = body.get("metadata", {})
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
            "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "generation",
                                                  "ownerReferences")},
            "spec": body.get("spec") or {}, "status": body.get("status") or {}}


def _pool_keys(body: kopf.Body) -> dict[Any, dict[str, Any]]:
    snap = snapshot(body)
    meta = snap["metadata"]
    keys: dict[Any, dict[str, Any]] = {("uid", meta["uid"]): snap,
                                       ("name", meta["namespace"], meta["name"]): snap}
    for ref in snap["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == "InferenceModel":
            keys[("model", ref.get("uid"))] = snap
    return keys


@kopf.index(GROUP, VERSION, "inferencemodels")
async def models_by_name(body: kopf.Body, **_: Any) -> dict[Any, dict[str, Any]]:
    """Indexes InferenceModels by (namespace, name)."""
    meta = body.get("metadata", {})
    return {(meta.get("namespace"), meta.get("name")): snapshot(body)}


@kopf.index(GROUP, VERSION, "prefillpools")
async def prefill_pools(body: kopf.Body, **_: Any) -> dict[Any, dict[str, Any]]:
    """Indexes PrefillPools by ('uid', uid), ('name', namespace, name) and ('model', owning
    InferenceModel uid)."""
    return _pool_keys(body)


@kopf.index(GROUP, VERSION, "decodepools")
async def decode_pools(body: kopf.Body, **_: Any) -> dict[Any, dict[str, Any]]:
    """Indexes DecodePools by ('uid', uid), ('name', namespace, name) and ('model', owning
    InferenceModel uid)."""
    return _pool_keys(body)


def first(index: kopf.Index | None, key: Any) -> dict[str, Any] | None:
    """Gives one indexed value under `key`, or None."""
    if index is None:
        return None
    return next(iter(index.get(key, ())), None)


def every(indexes: Iterable[kopf.Index], key: Any) -> list[dict[str, Any]]:
    """Gives all values under `key` across several indexes."""
    return [value for index in indexes for value in index.get(key, ())]
