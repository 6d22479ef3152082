"""Watching the pods of pools and the weights Jobs: indexes, the events that refresh status, and
two timers for what no event announces (a deadline passing, a download's progress).

The watch on pods is narrowed on the server to pods carrying `kvpilot.dev/model`
(lifecycle.operator_settings), so a large cluster's other pods never reach the operator.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.handlers.indexes import first
from kvpilot.operator.handlers.observed import Observed
from kvpilot.operator.handlers.rollup import refresh_model, refresh_pool
from kvpilot.operator.kube.errors import KubeError
from kvpilot.operator.render.meta import GROUP_VERSION, MODEL_LABEL, POOL_LABEL
from kvpilot.operator.render.weight_cache import WEIGHTS_LABEL
from kvpilot.operator.weights.progress import last_percent

GROUP, VERSION = GROUP_VERSION.split("/")
DEADLINE_CHECK_SECONDS = 30
PROGRESS_READ_SECONDS = 15
LOG_TAIL_LINES = 5
logger = logging.getLogger(__name__)


def pod_snapshot(body: kopf.Body) -> dict[str, Any]:
    """Gives the parts of a pod (or Job) that status reasons read."""
    meta, status = body.get("metadata", {}), body.get("status") or {}
    return {"kind": body.get("kind"),
            "metadata": {k: meta.get(k) for k in ("name", "namespace", "creationTimestamp",
                                                  "deletionTimestamp", "labels")},
            "status": {k: status.get(k) for k in ("phase", "conditions", "containerStatuses",
                                                  "initContainerStatuses", "active", "failed",
                                                  "succeeded") if k in status}}


@kopf.index("", "v1", "pods", labels={POOL_LABEL: kopf.PRESENT})
async def pods_by_pool(body: kopf.Body, **_: Any) -> dict[Any, dict[str, Any]]:
    """Indexes engine pods by (namespace, pool name)."""
    meta = body.get("metadata", {})
    return {(meta.get("namespace"), meta["labels"][POOL_LABEL]): pod_snapshot(body)}


@kopf.index("", "v1", "pods", labels={WEIGHTS_LABEL: kopf.PRESENT})
async def weight_job_pods(body: kopf.Body, **_: Any) -> dict[Any, dict[str, Any]]:
    """Indexes the weights Jobs' pods by (namespace, cache claim)."""
    meta = body.get("metadata", {})
    return {(meta.get("namespace"), meta["labels"][WEIGHTS_LABEL]): pod_snapshot(body)}


@kopf.index("batch", "v1", "jobs", labels={WEIGHTS_LABEL: kopf.PRESENT})
async def weight_jobs(body: kopf.Body, **_: Any) -> dict[Any, dict[str, Any]]:
    """Indexes the weights Jobs by (namespace, cache claim)."""
    meta = body.get("metadata", {})
    return {(meta.get("namespace"), meta["labels"][WEIGHTS_LABEL]): pod_snapshot(body)}


async def _refresh_model_of(body: kopf.Body, memo: kopf.Memo, observed: Observed) -> None:
    meta = body.get("metadata", {})
    model = (meta.get("labels") or {}).get(MODEL_LABEL)
    im = first(observed.models, (meta.get("namespace"), model)) if model else None
    if im is not None:
        await refresh_model(memo.kube, im, observed)


@kopf.on.event("", "v1", "pods", labels={POOL_LABEL: kopf.PRESENT})
async def pool_pod_changed(body: kopf.Body, type: str | None, memo: kopf.Memo,
                           **kwargs: Any) -> None:
    """Re-derives the pool's reasons, and the model's weights, when one of its pods changes."""
    if type is None:  # the initial listing: the pools' own handlers count it
        return
    observed = Observed.of(kwargs)
    meta = body.get("metadata", {})
    pool = observed.pool_named(meta.get("namespace"), meta["labels"][POOL_LABEL])
    if pool is not None:
        await refresh_pool(memo.kube, pool, observed)
    await _refresh_model_of(body, memo, observed)


@kopf.on.event("", "v1", "pods", labels={WEIGHTS_LABEL: kopf.PRESENT})
@kopf.on.event("batch", "v1", "jobs", labels={WEIGHTS_LABEL: kopf.PRESENT})
async def weights_job_changed(body: kopf.Body, type: str | None, memo: kopf.Memo,
                              **kwargs: Any) -> None:
    """Re-derives the model's weights when its weights Job or one of the Job's pods changes."""
    if type is not None:
        await _refresh_model_of(body, memo, Observed.of(kwargs))


def _short_of_replicas(spec: kopf.Spec, status: kopf.Status, **_: Any) -> bool:
    return int(status.get("readyReplicas") or 0) < int(spec.get("replicas", 1))


@kopf.timer(GROUP, VERSION, "prefillpools", interval=DEADLINE_CHECK_SECONDS,
            when=_short_of_replicas)
@kopf.timer(GROUP, VERSION, "decodepools", interval=DEADLINE_CHECK_SECONDS,
            when=_short_of_replicas)
async def check_deadline(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    """Re-derives a pool's reasons while replicas are missing: a pod passing its progress
    deadline changes nothing the API server would announce."""
    observed = Observed.of(kwargs)
    meta = body["metadata"]
    pool = observed.pool_named(meta["namespace"], meta["name"])
    if pool is not None:
        await refresh_pool(memo.kube, pool, observed)


def _downloading(status: kopf.Status, **_: Any) -> bool:
    return (status.get("weights") or {}).get("phase") == "Downloading"


@kopf.timer(GROUP, VERSION, "inferencemodels", interval=PROGRESS_READ_SECONDS,
            when=_downloading)
async def read_progress(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    """Reads the downloading container's last progress line into status.weights.progress."""
    observed = Observed.of(kwargs)
    meta = body["metadata"]
    im = first(observed.models, (meta["namespace"], meta["name"]))
    if im is None:
        return
    view = observed.weights(im, InferenceModelSpec.model_validate(im["spec"]), time.time())
    if view is None or view.tail is None:
        return
    pod, container = view.tail
    try:
        log = await memo.kube.log(meta["namespace"], pod, container, LOG_TAIL_LINES)
    except (KubeError, OSError) as exc:
        logger.info("reading the progress of %s/%s: %s", pod, container, exc)
        return
    await refresh_model(memo.kube, im, observed, last_percent(log))
