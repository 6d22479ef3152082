"""Overrides that contradict what the operator derives: refused naming both fields.

The operator derives a replica's GPUs from `topology` and `accelerator`, its pods'
selector labels from the object's names, their scrape annotations from the engine's port
and metrics path, part of their environment (the rendezvous, the API key, HF_TOKEN,
POD_IP) and a node requirement from `accelerator.model`; the engine's command, ports and
probes are not in `overrides` at all (`api/overrides.py` refuses those keys). An override
of one of the derived values is either silently overwritten by the operator or fights it
(a pod asking 4 GPUs for a tensorParallel=8 engine; a nodeSelector no node of the
accelerator's model carries): both are refused here, before anything is applied.
"""

from __future__ import annotations

from kvpilot.engine.contracts.args import API_KEY_ENV
from kvpilot.engine.contracts.rendezvous import RENDEZVOUS_ENV
from kvpilot.operator.api.formats import parse_quantity
from kvpilot.operator.planning.pool import ResolvedPool
from kvpilot.operator.render.meta import (
    COMPONENT_LABEL,
    ENGINE_PORT,
    MODEL_LABEL,
    POOL_LABEL,
    REPLICA_LABEL,
    ROLE_LABEL,
)

GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")
GPU_RESOURCE_PREFIXES = ("nvidia.com/mig-", "amd.com/")
# env the engine container gets from the operator -> where it comes from
OWNED_ENV = {"POD_IP": "the pod's IP, from the downward API",
             "HF_TOKEN": "model.secretRef",
             API_KEY_ENV: "auth.apiKeySecretRef",
             **{name: "the multi-node rendezvous (topology, accelerator.gpusPerNode)"
                for name in RENDEZVOUS_ENV}}
OWNED_LABELS = (MODEL_LABEL, POOL_LABEL, ROLE_LABEL, COMPONENT_LABEL, REPLICA_LABEL)
# scrape annotations -> the value the operator renders
OWNED_ANNOTATIONS = {"prometheus.io/port": str(ENGINE_PORT), "prometheus.io/path": "/metrics"}


def check_owned_fields(pool: ResolvedPool) -> None:
    """Raises ValueError naming the override and the field it contradicts, when the pool's
    overrides set something the operator derives."""
    messages = [m for m in _contradictions(pool) if m]
    if messages:
        where = f"{pool.role} pool: " if pool.role != "both" else ""
        raise ValueError(where + "; ".join(messages))


def _contradictions(pool: ResolvedPool) -> list[str]:
    overrides, placement = pool.overrides, pool.placement
    out = []
    for section in ("requests", "limits"):
        for name, value in getattr(overrides.resources, section).items():
            if name in GPU_RESOURCES or name.startswith(GPU_RESOURCE_PREFIXES) \
                    or name == placement.gpu_resource:
                out.append(_gpu_contradiction(pool, f"overrides.resources.{section}.{name}",
                                              name, value))
    for name in overrides.env:
        if name in OWNED_ENV:
            out.append(f"overrides.env.{name} is rendered by the operator from "
                       f"{OWNED_ENV[name]}: remove it from overrides.env")
    for key in overrides.labels:
        if key in OWNED_LABELS:
            out.append(f"overrides.labels.{key} is the operator's pod label (the pool's "
                       "Services, PodDisruptionBudget and router select by it): remove it or "
                       "use another key")
    for key, rendered in OWNED_ANNOTATIONS.items():
        given = overrides.annotations.get(key)
        if given is not None and given != rendered:
            out.append(f"overrides.annotations.{key}={given!r} contradicts the engine's "
                       f"{'port' if key.endswith('port') else 'metrics path'} {rendered!r} "
                       "(the operator renders both): remove the annotation")
    out += _node_selector_contradictions(pool)
    return out


def _gpu_contradiction(pool: ResolvedPool, field: str, name: str, value: str | int) -> str:
    """Gives why a GPU resource in the overrides contradicts the topology ('' when it asks
    exactly what the operator requests)."""
    placement, accelerator, topology = pool.placement, pool.accelerator, pool.topology
    if placement.gpu_resource is None:
        return (f"{field}={value} with accelerator.vendor={accelerator.vendor}: a CPU replica "
                "runs on no GPU; remove it, or set accelerator.vendor")
    derived = (f"topology.tensorParallel={topology.tensor_parallel} x pipelineParallel="
               f"{topology.pipeline_parallel}, {placement.gpus_per_pod} "
               f"{placement.gpu_resource} per pod over {placement.nodes_per_replica} node(s)")
    if name != placement.gpu_resource:
        return (f"{field} with accelerator.vendor={accelerator.vendor}: the operator requests "
                f"{derived}; remove it from overrides.resources")
    if parse_quantity(value) != placement.gpus_per_pod:
        return (f"{field}={value} contradicts {derived}: the operator requests the GPUs the "
                "topology needs; remove it from overrides.resources or change the topology")
    return ""


def _node_selector_contradictions(pool: ResolvedPool) -> list[str]:
    """Gives the overrides.nodeSelector entries no node the accelerator needs can carry: a
    key every node term of the accelerator requires to be In other values."""
    terms = pool.placement.node_selector_terms
    out = []
    for key, value in pool.overrides.node_selector.items():
        excluded = [next((e for e in term if e.get("key") == key and e.get("operator") == "In"
                          and value not in e.get("values", [])), None) for term in terms]
        if terms and all(excluded):
            allowed = sorted({str(v) for e in excluded if e for v in e.get("values", [])})
            out.append(f"overrides.nodeSelector.{key}={value!r} contradicts accelerator.model="
                       f"{pool.accelerator.model} (whose nodes carry {key} in {allowed}): no "
                       "node matches both; remove the selector or change accelerator.model")
    return out
