"""status.weights on the kmock emulator: the cache claim and Job appear, the Job pod's progress
line becomes 'Downloading n%', completion 'Cached', a failed Job WeightsDownloadFailed; the claim
and the Job are server-side applied by kvpilot like every other child."""

from __future__ import annotations

from typing import Any

import httpx
from helpers.kubectl_view import argocd_health, columns
from helpers.pod_states import pod, running, terminated
from kube_api import ApiServer
from operator_harness import IMS, NAMESPACE, eventually
from test_field_ownership import owners
from test_reconcile_kmock import IM_PATH, MERGE, tiny
from test_status_reasons_kmock import PODS, condition, set_pod_status

JOBS = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"
GATED = "kvpilot fetch: error: acme/llama is gated: set spec.model.secretRef to a Secret"
# The progress timer reads every 15 s; allow two reads on a loaded machine.
PROGRESS_WITHIN = 40


def hf_model(name: str, cache: bool) -> dict[str, Any]:
    manifest = tiny(name)
    manifest["spec"]["model"] = {"name": name, "source": "hf://acme/llama", "revision": "v1",
                                 **({"cache": {"size": "20Gi"}} if cache else {})}
    return manifest


def weights(api: ApiServer, name: str) -> dict[str, Any]:
    return ((api.get(IMS, NAMESPACE, name) or {}).get("status") or {}).get("weights") or {}


async def job_pod(client: httpx.AsyncClient, model: str, claim: str, name: str,
                  container: dict[str, Any]) -> None:
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": NAMESPACE,
        "labels": {"kvpilot.dev/model": model, "kvpilot.dev/weights": claim}},
        "spec": {"containers": [{"name": "fetch-model", "image": "operator"}]}}
    assert (await client.post(PODS, json=body)).status_code == 200
    await set_pod_status(client, name, pod(name, containers=[container])["status"])


async def test_the_cache_job_reports_progress_then_cached(api, operator, client):
    assert (await client.post(IM_PATH, json=hf_model("big", cache=True))).status_code == 200
    job = await eventually(lambda: next(iter(api.live("batch/v1/jobs", NAMESPACE)), None),
                           what="the weights Job")
    claim = job["metadata"]["labels"]["kvpilot.dev/weights"]
    stored_claim = api.get("v1/persistentvolumeclaims", NAMESPACE, claim)
    assert stored_claim["spec"]["resources"] == {"requests": {"storage": "20Gi"}}
    # Both are children like any other: server-side applied, their fields owned by kvpilot.
    assert owners(stored_claim, "spec", "resources") == {"kvpilot"}
    assert owners(job, "spec", "template") == {"kvpilot"}
    assert {e["operation"] for o in (stored_claim, job) for e in o["metadata"]["managedFields"]
            if e["manager"] == "kvpilot"} == {"Apply"}
    await eventually(lambda: weights(api, "big").get("phase") == "Pending", what="Pending")
    api.pod_logs[(NAMESPACE, "big-job-0", "fetch-model")] = (
        "kvpilot fetch: acme/llama@v1 is commit abc: 4 files\n"
        "kvpilot fetch: 42% (42 of 100 bytes)\n")
    await job_pod(client, "big", claim, "big-job-0", running("fetch-model"))
    await eventually(lambda: weights(api, "big").get("phase") == "Downloading",
                     what="Downloading")
    await eventually(lambda: weights(api, "big").get("state") == "Downloading 42%",
                     timeout=PROGRESS_WITHIN, what="the percent from the log")
    assert columns(api.get(IMS, NAMESPACE, "big"))["WEIGHTS"] == "Downloading 42%"
    await client.patch(f"{JOBS}/{job['metadata']['name']}/status", headers=MERGE, json={
        "status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}})
    done = await eventually(lambda: (w := weights(api, "big")).get("phase") == "Cached" and w,
                            what="Cached")
    assert (done["state"], done["progress"], done["claim"]) == ("Cached", 100, claim)


async def test_a_failed_cache_job_degrades_the_model(api, operator, client):
    assert (await client.post(IM_PATH, json=hf_model("gated", cache=True))).status_code == 200
    job = await eventually(lambda: next(iter(api.live("batch/v1/jobs", NAMESPACE)), None),
                           what="the weights Job")
    claim = job["metadata"]["labels"]["kvpilot.dev/weights"]
    await job_pod(client, "gated", claim, "gated-job-0",
                  terminated("fetch-model", 2, message=GATED))
    await client.patch(f"{JOBS}/{job['metadata']['name']}/status", headers=MERGE, json={
        "status": {"failed": 1, "conditions": [{"type": "Failed", "status": "True",
                                                "reason": "PodFailurePolicy"}]}})
    im = await eventually(lambda: (o := api.get(IMS, NAMESPACE, "gated"))
                          and condition(o, "Degraded").get("reason") == "WeightsDownloadFailed"
                          and o, what="WeightsDownloadFailed")
    assert GATED in condition(im, "Degraded")["message"]
    assert (columns(im)["REASON"], columns(im)["WEIGHTS"]) == ("WeightsDownloadFailed", "Failed")
    assert argocd_health(im)[0] == "Degraded"
    await eventually(lambda: any(e["reason"] == "WeightsDownloadFailed"
                                 for e in api.live("v1/events", NAMESPACE)
                                 if e["involvedObject"]["name"] == "gated"), what="an Event")


async def test_each_pod_downloading_its_own_copy_shows_its_progress(api, operator, client):
    assert (await client.post(IM_PATH, json=hf_model("own", cache=False))).status_code == 200
    await eventually(lambda: api.get("apps/v1/deployments", NAMESPACE, "own-decode"))
    api.pod_logs[(NAMESPACE, "own-decode-0", "fetch-model")] = "kvpilot fetch: 7% (7 of 100 bytes)\n"
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "own-decode-0", "namespace": NAMESPACE,
        "labels": {"kvpilot.dev/model": "own", "kvpilot.dev/pool": "own-decode"}},
        "spec": {"containers": [{"name": "engine", "image": "engine"}]}}
    assert (await client.post(PODS, json=body)).status_code == 200
    await set_pod_status(client, "own-decode-0",
                         pod("own-decode-0", init=[running("fetch-model")])["status"])
    await eventually(lambda: weights(api, "own").get("state") == "Downloading 7%",
                     timeout=PROGRESS_WITHIN, what="the pod's percent")
    await set_pod_status(client, "own-decode-0", pod("own-decode-0", init=[
        terminated("fetch-model", 0, "Completed")], containers=[running("engine")],
        phase="Running")["status"])
    await eventually(lambda: weights(api, "own").get("phase") == "Downloaded", what="Downloaded")
