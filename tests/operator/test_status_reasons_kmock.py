"""Failing replicas explain themselves: on the kmock emulator, each simulated pod state or
controller condition gives its reason on the pool and the model, in the REASON column, in an
Event and in Argo CD's health, within the events it causes (no timer); recovery clears it."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from helpers.kubectl_view import argocd_health, columns
from helpers.pod_states import (
    CRASH,
    FETCH_FAILED,
    OOM,
    PULL,
    UNSCHEDULABLE,
    pod,
    running,
)
from kube_api import ApiServer
from operator_harness import IMS, NAMESPACE, eventually
from test_reconcile_kmock import IM_PATH, MERGE, tiny

PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
POOLS = "kvpilot.dev/v1alpha1/decodepools"
# Shorter than the deadline timer's 30 s: a reason that shows up in time came from an event.
WITHIN = 20.0


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    return next((c for c in (obj or {}).get("status", {}).get("conditions", [])
                 if c["type"] == kind), {})


async def start_model(api: ApiServer, client: httpx.AsyncClient, name: str) -> None:
    assert (await client.post(IM_PATH, json=tiny(name))).status_code == 200
    await eventually(lambda: api.get("apps/v1/deployments", NAMESPACE, f"{name}-decode"),
                     what="decode Deployment")
    await eventually(lambda: condition(api.get(POOLS, NAMESPACE, f"{name}-decode"),
                                       "Ready").get("reason") == "ReplicasNotReady",
                     what="pool status")


async def put_pod(client: httpx.AsyncClient, model: str, manifest: dict[str, Any]) -> str:
    """Creates an engine pod of the model's decode pool with `manifest`'s status (the kubelet's
    and the scheduler's part); gives its name."""
    name = manifest["metadata"]["name"]
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": NAMESPACE, "creationTimestamp": manifest["metadata"][
            "creationTimestamp"],
        "labels": {"kvpilot.dev/model": model, "kvpilot.dev/pool": f"{model}-decode"}},
        "spec": {"containers": [{"name": "engine", "image": "engine"}]}}
    response = await client.post(PODS, json=body)
    assert response.status_code == 200, response.text
    await set_pod_status(client, name, manifest["status"])
    return name


async def set_pod_status(client: httpx.AsyncClient, name: str, status: dict[str, Any]) -> None:
    response = await client.patch(f"{PODS}/{name}/status", json={"status": status},
                                  headers=MERGE)
    assert response.status_code == 200, response.text


def events(api: ApiServer, kind: str, name: str) -> list[tuple[str, str, str]]:
    return [(e["reason"], e["type"], e["message"]) for e in api.live("v1/events", NAMESPACE)
            if e["involvedObject"]["kind"] == kind and e["involvedObject"]["name"] == name]


def now_text(offset: float = 0.0) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + offset))


FAILURES = [
    ("Unschedulable", {"scheduled": UNSCHEDULABLE}, "Insufficient nvidia.com/gpu"),
    ("ImagePullFailed", {"containers": [PULL]}, "ImagePullBackOff"),
    ("WeightsDownloadFailed", {"init": [FETCH_FAILED]}, "is gated: set spec.model.secretRef"),
    ("CrashLoop", {"containers": [CRASH], "phase": "Running"}, "keeps exiting (exit code 1"),
    ("OOMKilled", {"containers": [OOM], "phase": "Running"}, "exceeding its memory limit"),
]


@pytest.mark.parametrize(("reason", "state", "detail"), FAILURES, ids=[f[0] for f in FAILURES])
async def test_a_failing_pod_names_its_reason_and_recovers(api, operator, client, reason, state,
                                                           detail):
    model = reason.lower()
    await start_model(api, client, model)
    started = time.monotonic()
    pod_name = await put_pod(client, model, pod(f"{model}-decode-7f9c-x2", since=now_text(),
                                                **state))
    im = await eventually(lambda: (o := api.get(IMS, NAMESPACE, model))
                          and condition(o, "Degraded").get("reason") == reason and o,
                          timeout=WITHIN, what=f"{reason} on the model")
    assert time.monotonic() - started < WITHIN
    pool = api.get(POOLS, NAMESPACE, f"{model}-decode")
    for obj, prefix in ((pool, f"pod {pod_name}: "), (im, f"{model}-decode: pod {pod_name}: ")):
        degraded = condition(obj, "Degraded")
        assert degraded["status"] == "True" and degraded["message"].startswith(prefix)
        assert detail in degraded["message"]
        assert columns(obj)["REASON"] == reason
        assert argocd_health(obj) == ("Degraded", degraded["message"])
    warnings = await eventually(lambda: [e for e in events(api, "InferenceModel", model)
                                         if e[0] == reason], what="an Event on the model")
    assert warnings[0][1] == "Warning" and detail in warnings[0][2]
    # The kubelet starts the engine, it loads, the Deployment counts it: all clear.
    await set_pod_status(client, pod_name, pod(pod_name, containers=[running("engine", True)],
                                               ready=True, phase="Running")["status"])
    await client.patch(f"{DEPLOYMENTS}/{model}-decode/status", headers=MERGE,
                       json={"status": {"replicas": 1, "readyReplicas": 1}})
    im = await eventually(lambda: (o := api.get(IMS, NAMESPACE, model))
                          and condition(o, "Ready").get("status") == "True" and o,
                          timeout=WITHIN, what="recovery")
    assert condition(im, "Degraded")["status"] == "False"
    assert columns(im)["REASON"] == "AllReplicasReady"
    assert argocd_health(im)[0] == "Healthy"
    await eventually(lambda: any(e[0] == "Recovered" for e in events(api, "InferenceModel",
                                                                      model)),
                     what="a Recovered event")


async def test_a_deployment_past_its_progress_deadline_degrades_the_model(api, operator, client):
    await start_model(api, client, "slow")
    deployment = api.get("apps/v1/deployments", NAMESPACE, "slow-decode")
    assert deployment["spec"]["progressDeadlineSeconds"] == 3600
    stalled = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
               "message": 'ReplicaSet "slow-decode-5d" has timed out progressing.'}
    await client.patch(f"{DEPLOYMENTS}/slow-decode/status", headers=MERGE,
                       json={"status": {"replicas": 1, "conditions": [stalled]}})
    im = await eventually(lambda: (o := api.get(IMS, NAMESPACE, "slow"))
                          and condition(o, "Degraded").get("reason") ==
                          "ProgressDeadlineExceeded" and o, timeout=WITHIN, what="deadline")
    assert condition(im, "Ready")["message"] == (
        'slow-decode: Deployment/slow-decode: ReplicaSet "slow-decode-5d" has timed out '
        "progressing.")
    assert argocd_health(im)[0] == "Degraded"
    progressing = {**stalled, "status": "True", "reason": "NewReplicaSetAvailable"}
    await client.patch(f"{DEPLOYMENTS}/slow-decode/status", headers=MERGE, json={
        "status": {"replicas": 1, "readyReplicas": 1, "conditions": [progressing]}})
    await eventually(lambda: condition(api.get(IMS, NAMESPACE, "slow"), "Ready")
                     .get("status") == "True", timeout=WITHIN, what="recovery")


@pytest.mark.slow
async def test_a_pod_not_ready_past_the_deadline_is_found_by_the_timer(api, operator, client):
    manifest = tiny("late", progressDeadlineSeconds=60)
    assert (await client.post(IM_PATH, json=manifest)).status_code == 200
    await eventually(lambda: api.get("apps/v1/deployments", NAMESPACE, "late-decode"))
    # Loading for 45 s: inside the deadline when the pod's event arrives, past it 15 s later,
    # when nothing announces it; the pools' 30 s timer must notice.
    await put_pod(client, "late", pod("late-decode-1", containers=[running("engine")],
                                      phase="Running", since=now_text(-45)))
    await eventually(lambda: condition(api.get(POOLS, NAMESPACE, "late-decode"), "Ready")
                     .get("reason") == "ReplicasNotReady", what="inside the deadline")
    im = await eventually(lambda: (o := api.get(IMS, NAMESPACE, "late"))
                          and condition(o, "Degraded").get("reason") ==
                          "ProgressDeadlineExceeded" and o, timeout=90, what="deadline")
    assert "past progressDeadlineSeconds=60" in condition(im, "Degraded")["message"]
