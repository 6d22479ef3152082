"""What an InferenceModel owns: its pools, its router, and the engine ConfigMap.

Aggregated serving gets one DecodePool with engine role `both`; disaggregated
serving one PrefillPool and one DecodePool. Pools are rendered with every
section resolved from the InferenceModel (topology, accelerator, communication,
overrides), so a change there changes the pool's spec and its generation, and
the pool's own handler rolls its workloads.
"""

from __future__ import annotations

from typing import Any

from kvpilot.operator.api.inference_model import InferenceModelSpec, PoolTemplate
from kvpilot.operator.api.pools import DecodePoolSpec, PoolSpec, PrefillPoolSpec
from kvpilot.operator.render.engine_args import serve_args
from kvpilot.operator.render.meta import (
    GROUP_VERSION,
    MODEL_LABEL,
    RenderConfig,
    child_name,
    object_meta,
)
from kvpilot.operator.render.placement import plan_placement
from kvpilot.operator.render.router import render_router

MODEL_GENERATION_ANNOTATION = "kvpilot.dev/model-generation"


def pool_name(model: str, role: str) -> str:
    """Gives the name of an InferenceModel's prefill or decode pool."""
    return child_name(model, "prefill" if role == "prefill" else "decode")


def pool_specs(spec: InferenceModelSpec, model: str) -> list[tuple[str, PoolSpec]]:
    """Gives (kind, spec) of each pool the InferenceModel asks for, every section resolved."""
    wanted: list[tuple[str, PoolTemplate, str]] = [("DecodePool", spec.decode, "both")]
    if spec.serving_mode == "disaggregated":
        assert spec.prefill is not None
        wanted = [("PrefillPool", spec.prefill, "prefill"), ("DecodePool", spec.decode, "decode")]
    out: list[tuple[str, PoolSpec]] = []
    for kind, template, role in wanted:
        cls = PrefillPoolSpec if kind == "PrefillPool" else DecodePoolSpec
        pool = cls(model_ref=model, role=role, replicas=template.replicas,  # type: ignore[arg-type]
                   topology=spec.pool_topology("prefill" if role == "prefill" else "decode"),
                   accelerator=spec.accelerator, communication=spec.communication,
                   autoscaling=template.autoscaling, overrides=template.overrides or spec.overrides)
        out.append((kind, pool))
    return out


def render_children(im: dict[str, Any], spec: InferenceModelSpec,
                    config: RenderConfig) -> list[dict[str, Any]]:
    """Gives the pools, router objects and engine ConfigMap of one InferenceModel."""
    model, namespace = im["metadata"]["name"], im["metadata"]["namespace"]
    objects: list[dict[str, Any]] = []
    serve_lines: dict[str, str] = {}
    for kind, pool in pool_specs(spec, model):
        role = pool.role  # type: ignore[attr-defined]
        name = pool_name(model, role)
        resolved = pool.resolved(spec)
        plan_placement(resolved)  # fail here, on the InferenceModel, not later on the pool
        serve_lines[f"{role}.args"] = "\n".join(serve_args(resolved, role,
                                                           config.drain_timeout_seconds))
        objects.append({
            "apiVersion": GROUP_VERSION, "kind": kind,
            # The generation annotation changes the pool whenever its InferenceModel changes
            # (e.g. engine settings the pool inherits), so the pool's handler re-renders it.
            "metadata": object_meta(name, namespace, {MODEL_LABEL: model}, im, annotations={
                MODEL_GENERATION_ANNOTATION: str(im["metadata"].get("generation", 1))}),
            "spec": pool.to_json(),
        })
    objects.append({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": object_meta(child_name(model, "engine"), namespace, {MODEL_LABEL: model}, im),
        "data": serve_lines,
    })
    if spec.router.replicas > 0:
        objects += render_router(model, namespace, spec, im, config)
    return objects
