"""What a reconcile handler writes when its object cannot be applied: conditions and an Event."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from kvpilot.operator.handlers.events import record
from kvpilot.operator.kube.client import Kube
from kvpilot.operator.kube.errors import transient
from kvpilot.operator.status import invalid_spec_conditions, merge_conditions

RETRY_SECONDS = 5


async def reject(kube: Kube, obj: Mapping[str, Any], patch: kopf.Patch, status: kopf.Status,
                 reason: str, message: str, now: str) -> None:
    """Writes Degraded `reason: message` into patch.status and posts a Warning event about `obj`.

    Retrying cannot fix a spec, so the caller returns after this and waits for the next edit.
    """
    generation = obj["metadata"].get("generation")
    patch.status["conditions"] = merge_conditions(
        status.get("conditions"), invalid_spec_conditions(reason, message, generation, now))
    patch.status["observedGeneration"] = generation
    await record(kube, obj, reason, message, warning=True)


async def reject_apply_error(exc: BaseException, kube: Kube, obj: Mapping[str, Any],
                             patch: kopf.Patch, status: kopf.Status, now: str) -> None:
    """Raises kopf.TemporaryError for a transient API error, else rejects `obj` as ApplyRejected.

    A transient error retries in RETRY_SECONDS instead of kopf's default minute; any other
    means the API server refused a rendered object (e.g. an invalid override).
    """
    if transient(exc):
        raise kopf.TemporaryError(f"applying children: {exc}", delay=RETRY_SECONDS) from exc
    await reject(kube, obj, patch, status, "ApplyRejected", str(exc), now)
