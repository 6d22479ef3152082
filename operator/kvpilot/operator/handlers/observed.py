"""What the watch streams hold now (kopf's in-memory indexes), read the way status needs it.

kopf passes every index to every handler as a keyword argument; `Observed.of(kwargs)`
collects them, so the status of a pool or a model is computed from one place whichever
event (a pod, a Job, a workload, a pool, a timer) asked for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.diagnose import Diagnosis, diagnose
from kvpilot.operator.handlers.indexes import every, first
from kvpilot.operator.planning.pool import PROGRESS_DEADLINE_SECONDS
from kvpilot.operator.render.children import pool_name, pool_specs
from kvpilot.operator.render.weights import model_location
from kvpilot.operator.weights.observe import WeightsView, cache_weights, pod_weights


def _get(index: kopf.Index | None, key: Any) -> list[dict[str, Any]]:
    return list(index.get(key, ())) if index is not None else []


@dataclass(frozen=True)
class Observed:
    """The indexes status is computed from; any may be None before kopf has built it."""

    models: kopf.Index | None = None
    prefill: kopf.Index | None = None
    decode: kopf.Index | None = None
    deployments: kopf.Index | None = None
    statefulsets: kopf.Index | None = None
    pods: kopf.Index | None = None
    jobs: kopf.Index | None = None
    job_pods: kopf.Index | None = None

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> Observed:
        """Gives the indexes among a handler's keyword arguments."""
        return cls(kwargs.get("models_by_name"), kwargs.get("prefill_pools"),
                   kwargs.get("decode_pools"), kwargs.get("deployments_by_pool"),
                   kwargs.get("statefulsets_by_pool"), kwargs.get("pods_by_pool"),
                   kwargs.get("weight_jobs"), kwargs.get("weight_job_pods"))

    def pool_named(self, namespace: str, name: str) -> dict[str, Any] | None:
        """Gives a PrefillPool or DecodePool by name."""
        key = ("name", namespace, name)
        return first(self.prefill, key) or first(self.decode, key)

    def pool_by_uid(self, uid: str) -> dict[str, Any] | None:
        return first(self.prefill, ("uid", uid)) or first(self.decode, ("uid", uid))

    def model_pools(self, model_uid: str) -> list[dict[str, Any]]:
        """Gives the pools an InferenceModel owns."""
        return every([i for i in (self.prefill, self.decode) if i is not None],
                     ("model", model_uid))

    def workloads(self, pool_uid: str) -> list[dict[str, Any]]:
        """Gives the Deployment or StatefulSets of a pool (kind, replicas, readiness)."""
        return [*_get(self.deployments, pool_uid), *_get(self.statefulsets, pool_uid)]

    def pool_pods(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        return _get(self.pods, (namespace, pool))

    def deadline(self, pool: Mapping[str, Any]) -> int:
        """Gives a stored pool's progressDeadlineSeconds: its own, its model's, else 3600."""
        spec = pool.get("spec") or {}
        own = spec.get("progressDeadlineSeconds")
        if own is None and spec.get("modelRef"):
            im = first(self.models, (pool["metadata"]["namespace"], spec["modelRef"]))
            own = ((im or {}).get("spec") or {}).get("progressDeadlineSeconds")
        return int(own or PROGRESS_DEADLINE_SECONDS)

    def pool_failure(self, pool: Mapping[str, Any], workloads: list[dict[str, Any]],
                     now: float) -> Diagnosis | None:
        """Gives why the pool's replicas are not ready, from its pods and `workloads`."""
        meta = pool["metadata"]
        return diagnose(self.pool_pods(meta["namespace"], meta["name"]), workloads,
                        self.deadline(pool), now)

    def weights(self, im: Mapping[str, Any], spec: InferenceModelSpec, now: float,
                percent: int | None = None) -> WeightsView | None:
        """Gives where an InferenceModel's weights are (None: its source downloads nothing)."""
        meta = im["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        location = model_location(spec.model, name)
        if location.fetch is None:
            return None
        previous = (im.get("status") or {}).get("weights")
        if location.cache_claim is not None:
            key = (namespace, location.cache_claim)
            return cache_weights(location.cache_claim, _get(self.jobs, key),
                                 _get(self.job_pods, key), previous, percent,
                                 spec.progress_deadline_seconds or PROGRESS_DEADLINE_SECONDS,
                                 now)
        pods = [p for pool in pool_specs(spec, name)
                for p in self.pool_pods(namespace, pool_name(name, pool.role))]
        return pod_weights(pods, previous, percent)
