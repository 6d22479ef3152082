"""Creating a model's fleet Secret once: never read, never overwritten.

The operator holds only `create` on Secrets: it cannot read anyone's Secret, and a fleet
secret, once created, stays what the running engines and routers hold. A 409 means it
exists (the owner reference removes it with its model).
"""

from __future__ import annotations

from typing import Any

from kvpilot.operator.kube.client import Kube
from kvpilot.operator.kube.errors import KubeError
from kvpilot.operator.render.fleet import fleet_secret


async def ensure_fleet_secret(kube: Kube, model: str, namespace: str,
                              owner: dict[str, Any]) -> bool:
    """Creates `model`'s fleet Secret unless one exists; gives whether it created it."""
    try:
        await kube.create(fleet_secret(model, namespace, owner))
    except KubeError as exc:
        if exc.status == 409:
            return False
        raise
    return True
