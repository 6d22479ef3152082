"""The InferencePool (Gateway API inference extension) that puts a model's engines behind a gateway.

It selects the pods that serve the model's whole requests (the aggregated pool's, leaders only
when a replica spans nodes) on the engine port, and names the user's endpoint picker. The
picker scrapes the engines' /metrics for the names vLLM exports (queue:
vllm:num_requests_waiting, vllm:num_requests_running; KV: vllm:kv_cache_usage_perc; block size
for its prefix scorer: vllm:cache_config_info), which kvpilot's engines serve.
"""

from __future__ import annotations

from typing import Any

from kvpilot.operator.api.gateway import InferencePoolSpec
from kvpilot.operator.planning.pool import ResolvedPool
from kvpilot.operator.render.meta import (
    ENGINE_PORT,
    MODEL_LABEL,
    RenderConfig,
    object_meta,
    pool_labels,
)
from kvpilot.operator.render.services import serving_selector

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"


def render_inference_pool(model: str, namespace: str, pool_name: str, pool: ResolvedPool,
                          spec: InferencePoolSpec, owner: dict[str, Any],
                          config: RenderConfig) -> dict[str, Any]:
    """Gives the InferencePool, named like the model, selecting the serving pool's engines."""
    labels = pool_labels(model, pool_name, pool.role)
    selector = serving_selector(labels, pool.placement.nodes_per_replica > 1,
                                config.leader_worker_set)
    picker = spec.endpoint_picker
    return {
        "apiVersion": INFERENCE_POOL_API, "kind": "InferencePool",
        "metadata": object_meta(model, namespace, {MODEL_LABEL: model}, owner),
        "spec": {
            "selector": {"matchLabels": selector},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {"name": picker.name, "port": {"number": picker.port},
                                  "failureMode": picker.failure_mode},
        },
    }
