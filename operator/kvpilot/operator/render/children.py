"""What an InferenceModel owns: its pools, its router, the engine ConfigMap, its weight cache
and its InferencePool.

Aggregated serving gets one DecodePool with engine role `both`; disaggregated
serving one PrefillPool and one DecodePool. Pools are rendered with every
section resolved from the InferenceModel (topology, accelerator, communication,
overrides), so a change there changes the pool's spec and its generation, and
the pool's own handler rolls its workloads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.api.inference_model import InferenceModelSpec, PoolTemplate, TemplateRole
from kvpilot.operator.api.names import check_name, engine_config_name, pool_name
from kvpilot.operator.api.pools import AnyPoolSpec, DecodePoolSpec, PrefillPoolSpec
from kvpilot.operator.planning.pool import ResolvedPool, resolve_pool
from kvpilot.operator.render.engine_args import serve_args
from kvpilot.operator.render.gateway import render_inference_pool
from kvpilot.operator.render.meta import GROUP_VERSION, MODEL_LABEL, RenderConfig, object_meta
from kvpilot.operator.render.owned_fields import check_owned_fields
from kvpilot.operator.render.pool import check_pool_size
from kvpilot.operator.render.router import render_router
from kvpilot.operator.render.weight_cache import weight_cache
from kvpilot.operator.render.weights import model_location

MODEL_GENERATION_ANNOTATION = "kvpilot.dev/model-generation"


def pool_specs(spec: InferenceModelSpec, model: str) -> list[AnyPoolSpec]:
    """Gives the spec of each pool the InferenceModel asks for, as stored on the pool: every
    section the pool inherits written out, so a change of the model changes the pool."""
    def fields(template: PoolTemplate, role: TemplateRole) -> dict[str, Any]:
        return {"model_ref": model, "replicas": template.replicas,
                "topology": spec.pool_topology(role), "accelerator": spec.accelerator,
                "communication": spec.communication, "autoscaling": template.autoscaling,
                "overrides": template.overrides or spec.overrides,
                "auth": spec.auth if spec.auth.api_key_secret_ref else None,
                "progress_deadline_seconds": spec.progress_deadline_seconds}

    if spec.prefill is None:  # aggregated: one pool serves both phases
        return [DecodePoolSpec(role="both", **fields(spec.decode, "decode"))]
    return [PrefillPoolSpec(role="prefill", **fields(spec.prefill, "prefill")),
            DecodePoolSpec(role="decode", **fields(spec.decode, "decode"))]


@dataclass(frozen=True)
class OwnedPool:
    """One pool an InferenceModel owns: its name, the spec stored on it, and that spec resolved."""

    name: str
    spec: AnyPoolSpec
    resolved: ResolvedPool


def owned_pools(spec: InferenceModelSpec, model: str) -> list[OwnedPool]:
    """Gives the pools the InferenceModel asks for, each resolved against it; raises ValueError
    naming the field when one cannot run (so the InferenceModel fails, not later its pool)."""
    return [OwnedPool(pool_name(model, pool.role), pool, resolve_pool(pool, spec))
            for pool in pool_specs(spec, model)]


def render_children(im: dict[str, Any], spec: InferenceModelSpec, pools: Sequence[OwnedPool],
                    config: RenderConfig) -> list[dict[str, Any]]:
    """Gives the pools, router objects and engine ConfigMap of one InferenceModel whose pools
    `owned_pools` resolved."""
    model, namespace = im["metadata"]["name"], im["metadata"]["namespace"]
    objects: list[dict[str, Any]] = []
    for pool in pools:
        objects.append({
            "apiVersion": GROUP_VERSION, "kind": pool.spec.kind,
            # The generation annotation changes the pool whenever its InferenceModel changes
            # (e.g. engine settings the pool inherits), so the pool's handler re-renders it.
            "metadata": object_meta(pool.name, namespace, {MODEL_LABEL: model}, im, annotations={
                MODEL_GENERATION_ANNOTATION: str(im["metadata"].get("generation", 1))}),
            "spec": pool.spec.to_json(),
        })
    serve_lines = {f"{pool.resolved.role}.args":
                   "\n".join(serve_args(pool.resolved, config.drain_timeout_seconds))
                   for pool in pools}
    objects.append({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": object_meta(engine_config_name(model), namespace, {MODEL_LABEL: model}, im),
        "data": serve_lines,
    })
    location = model_location(spec.model, model)
    if location.cache_claim is not None:
        objects += weight_cache(im, spec.model, location.cache_claim, config,
                                spec.overrides.env)
    if spec.router.replicas > 0:
        objects += render_router(model, namespace, spec, im, config)
    if spec.inference_pool is not None:
        if not config.inference_pool:
            raise ValueError("spec.inferencePool is set but the operator runs without "
                             "--inference-pool: install the InferencePool CRD (Gateway API "
                             "inference extension) and set operator.inferencePool=true in the "
                             "chart, or remove spec.inferencePool")
        serving = next(p for p in pools if p.resolved.role == "both")  # aggregated only
        objects.append(render_inference_pool(model, namespace, serving.name, serving.resolved,
                                             spec.inference_pool, im, config))
    return objects


@dataclass(frozen=True)
class RenderedModel:
    """An InferenceModel parsed, its pools resolved and its children rendered."""

    spec: InferenceModelSpec
    pools: list[OwnedPool]
    children: list[dict[str, Any]]


def render_model(im: dict[str, Any], spec: Mapping[str, Any],
                 config: RenderConfig) -> RenderedModel:
    """Gives a stored InferenceModel's spec, pools and children; raises ValueError naming the
    field when any part cannot run, so nothing is applied for a spec the engine would refuse."""
    name = im["metadata"]["name"]
    check_name("InferenceModel", name)
    parsed = InferenceModelSpec.model_validate(dict(spec))
    pools = owned_pools(parsed, name)
    for pool in pools:
        check_pool_size(pool.resolved, config)
        check_owned_fields(pool.resolved)
    return RenderedModel(parsed, pools, render_children(im, parsed, pools, config))
