"""Everything one PrefillPool or DecodePool owns: workloads, Services, PodDisruptionBudget and
NetworkPolicy (and, without an InferenceModel, its fleet Secret, created once: `handlers/children.py`)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvpilot.operator.api.names import check_name
from kvpilot.operator.planning.pool import ResolvedPool
from kvpilot.operator.render.meta import RenderConfig, pool_labels, selector_labels
from kvpilot.operator.render.network import pool_network_policy
from kvpilot.operator.render.owned_fields import check_owned_fields
from kvpilot.operator.render.pdb import pool_pdb
from kvpilot.operator.render.services import pool_service, rendezvous_service
from kvpilot.operator.render.workloads import pool_workloads

SPEC_HASH_ANNOTATION = "kvpilot.dev/spec-hash"


def pool_model_name(pool: dict[str, Any]) -> str:
    """Gives the model label value of a pool: its InferenceModel's name, else its own."""
    return pool.get("spec", {}).get("modelRef") or pool["metadata"]["name"]


def spec_hash(pool: ResolvedPool) -> str:
    """Gives a short digest of a resolved pool; pods carry it so any change rolls them."""
    text = json.dumps(pool.to_json(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_pool_size(resolved: ResolvedPool, config: RenderConfig) -> None:
    """Raises ValueError naming spec.replicas when the pool asks for more GPUs than the
    operator renders for one pool (checked before any of its objects is built)."""
    per_replica = resolved.placement.gpus_per_pod * resolved.placement.nodes_per_replica
    gpus = resolved.replicas * per_replica
    if gpus > config.max_pool_gpus:
        raise ValueError(f"spec.replicas={resolved.replicas} x {per_replica} GPUs per replica = "
                         f"{gpus} GPUs > {config.max_pool_gpus}, the most the operator gives "
                         "one pool (kvpilot operator --max-pool-gpus): lower the replicas or "
                         "raise the limit")


def render_pool(pool: dict[str, Any], resolved: ResolvedPool,
                config: RenderConfig) -> list[dict[str, Any]]:
    """Gives the objects a stored pool owns, rendered from its resolved spec; raises
    ValueError naming the field when its name or size is out of bounds, or its overrides
    contradict what the operator derives."""
    name, namespace = pool["metadata"]["name"], pool["metadata"]["namespace"]
    check_name(pool["kind"], name)
    check_pool_size(resolved, config)
    check_owned_fields(resolved)
    labels = pool_labels(pool_model_name(pool), name, resolved.role)
    multi_node = resolved.placement.nodes_per_replica > 1
    objects = pool_workloads(name, namespace, resolved, labels, pool, config,
                             annotations={SPEC_HASH_ANNOTATION: spec_hash(resolved)})
    objects.append(pool_service(name, namespace, labels, pool, multi_node,
                                config.leader_worker_set))
    if multi_node and not config.leader_worker_set:
        objects.append(rendezvous_service(name, namespace, labels, pool))
    objects.append(pool_pdb(name, namespace, labels, pool))
    objects.append(pool_network_policy(name, namespace, labels, pool, resolved.allow_from,
                                       multi_node, config))
    return objects


def pool_role(pool: dict[str, Any]) -> str:
    """Gives a stored pool's engine role: its spec.role, else its kind's default."""
    default = "prefill" if pool["kind"] == "PrefillPool" else "both"
    return (pool.get("spec") or {}).get("role", default)


def pool_selector(pool: dict[str, Any]) -> str:
    """Gives the pool's pod label selector as text (the scale subresource's status.selector)."""
    labels = selector_labels(pool_labels(pool_model_name(pool), pool["metadata"]["name"],
                                         pool_role(pool)))
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
