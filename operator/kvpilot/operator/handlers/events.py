"""Kubernetes Events for the operator's decisions (what it created, changed, or refused) and for
each transition of an object's Ready or Degraded condition (kubectl describe shows both)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvpilot.operator.kube.client import Kube
from kvpilot.operator.kube.errors import KubeError
from kvpilot.operator.status import now_rfc3339, transition_event

logger = logging.getLogger(__name__)


def event(obj: Mapping[str, Any], reason: str, message: str, warning: bool = False,
          now: str | None = None) -> dict[str, Any]:
    """Gives a core/v1 Event about `obj` (a name unique per object and time, like kubectl's)."""
    meta = obj["metadata"]
    stamp = now or now_rfc3339()
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
                           "name": meta["name"], "namespace": meta["namespace"],
                           "uid": meta["uid"]},
        "reason": reason, "message": message[:1024], "type": "Warning" if warning else "Normal",
        "source": {"component": "kvpilot-operator"},
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


async def record(kube: Kube, obj: Mapping[str, Any], reason: str, message: str,
                 warning: bool = False) -> None:
    """Posts an Event; a failure is logged, never raised (events are best effort)."""
    try:
        await kube.create(event(obj, reason, message, warning))
    except (KubeError, OSError) as exc:
        logger.warning("could not post event %s for %s: %s", reason, obj["metadata"]["name"], exc)


async def record_transition(kube: Kube, obj: Mapping[str, Any],
                            old: Sequence[dict[str, Any]] | None,
                            new: Sequence[dict[str, Any]]) -> None:
    """Posts an Event when Ready or Degraded changed between `old` and `new` conditions."""
    change = transition_event(old, new)
    if change is not None:
        reason, message, warning = change
        await record(kube, obj, reason, message, warning=warning)
