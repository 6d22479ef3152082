"""Resolving a stored pool: its spec parsed, its InferenceModel found, its sections filled."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.pools import SPEC_BY_KIND
from kvpilot.operator.handlers.indexes import first
from kvpilot.operator.kube.client import Kube
from kvpilot.operator.planning.pool import ResolvedPool, resolve_pool
from kvpilot.operator.render.meta import GROUP_VERSION


async def resolve_stored_pool(kube: Kube, kind: str, namespace: str, spec: Mapping[str, Any],
                              models: kopf.Index | None) -> ResolvedPool:
    """Gives a stored pool's spec resolved against its InferenceModel (from the index, else a
    GET); raises ValueError naming the field when the spec is invalid or cannot run."""
    parsed = SPEC_BY_KIND[kind].model_validate(dict(spec))
    owner = None
    if parsed.model_ref is not None:
        im = first(models, (namespace, parsed.model_ref)) or \
            await kube.get(GROUP_VERSION, "InferenceModel", namespace, parsed.model_ref)
        owner = InferenceModelSpec.model_validate(im["spec"]) if im else None
    return resolve_pool(parsed, owner)
