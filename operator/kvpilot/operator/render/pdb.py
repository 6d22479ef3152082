"""The PodDisruptionBudget that keeps voluntary evictions to one engine pod of a pool at a time."""

from __future__ import annotations

from typing import Any

from kvpilot.operator.render.meta import object_meta, selector_labels


def pool_pdb(name: str, namespace: str, labels: dict[str, str],
             owner: dict[str, Any]) -> dict[str, Any]:
    """Gives a PDB allowing one unavailable pod of the pool (node drains go one by one)."""
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": object_meta(name, namespace, labels, owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(labels)}},
    }
