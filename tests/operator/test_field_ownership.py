"""Field ownership on the emulator: other writers' fields survive, HPA keeps replicas, drift is told.

The real operator writes its children by server-side apply; the emulator keeps managedFields
per manager (field_managers.py). Each test plays another writer with its own fieldManager:
`kubectl-edit` for a person, `kube-controller-manager` for an HPA on the scale subresource.
"""

from __future__ import annotations

from typing import Any

import httpx
from kube_api import ApiServer
from operator_harness import IMS, NAMESPACE, eventually, running_operator
from test_reconcile_kmock import IM_PATH, MERGE, deployment_args, tiny

POOLS = "kvpilot.dev/v1alpha1/decodepools"
POOL_PATH = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/decodepools"
DEPLOY_PATH = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
EDIT = {"fieldManager": "kubectl-edit"}


def owners(obj: dict[str, Any], *path: str) -> set[str]:
    """Gives the managers whose managedFields own the field at `path`."""
    out = set()
    for entry in obj["metadata"].get("managedFields", []):
        node = entry["fieldsV1"]
        for key in path:
            node = node.get(f"f:{key}")
            if node is None:
                break
        else:
            out.add(entry["manager"])
    return out


def events(api: ApiServer, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.live("v1/events", NAMESPACE) if e["reason"] == reason]


async def edit_model(client: httpx.AsyncClient, name: str, max_num_seqs: int) -> None:
    """Changes the model's engine settings, so kvpilot re-applies every child."""
    r = await client.patch(f"{IM_PATH}/{name}", headers=MERGE,
                           json={"spec": {"engine": {"maxNumSeqs": max_num_seqs}}})
    assert r.status_code == 200, r.text


async def rolled_out(api: ApiServer, deployment: str, max_num_seqs: int) -> None:
    await eventually(lambda: (a := deployment_args(api, deployment)) and "--max-num-seqs" in a
                     and a[a.index("--max-num-seqs") + 1] == str(max_num_seqs),
                     what=f"maxNumSeqs={max_num_seqs} rolled out")


async def resumed(api: ApiServer) -> None:
    """Waits until a restarted operator has re-applied the pool and its Deployment."""
    before = api.calls["update", "deployments"]
    await eventually(lambda: api.calls["update", "deployments"] > before, what="resume applies")


async def test_an_edit_of_a_field_kvpilot_does_not_own_survives_reconciles_and_restarts(
        api, client):
    await client.post(IM_PATH, json=tiny("ext"))
    async with running_operator():
        await eventually(lambda: deployment_args(api, "ext-decode"), what="decode Deployment")
        r = await client.patch(f"{DEPLOY_PATH}/ext-decode", params=EDIT, headers=MERGE, json={
            "metadata": {"annotations": {"team.example.com/owner": "search"}},
            "spec": {"revisionHistoryLimit": 3}})
        assert r.status_code == 200, r.text
        await edit_model(client, "ext", 8)
        await rolled_out(api, "ext-decode", 8)
    async with running_operator():
        await resumed(api)
    deployment = api.get("apps/v1/deployments", NAMESPACE, "ext-decode")
    assert deployment["metadata"]["annotations"]["team.example.com/owner"] == "search"
    assert deployment["spec"]["revisionHistoryLimit"] == 3
    assert owners(deployment, "spec", "revisionHistoryLimit") == {"kubectl-edit"}
    assert owners(deployment, "spec", "template") == {"kvpilot"}
    assert not events(api, "FieldConflict")


async def test_an_hpa_managed_pool_keeps_its_replicas_across_edits_and_restarts(api, client):
    manifest = tiny("hpa", decode={"replicas": 2, "autoscaling": {"mode": "external"}})
    await client.post(IM_PATH, json=manifest)
    async with running_operator():
        pool = await eventually(lambda: api.get(POOLS, NAMESPACE, "hpa-decode"), what="pool")
        await eventually(lambda: "kvpilot-handover" in owners(
            api.get(POOLS, NAMESPACE, "hpa-decode"), "spec", "replicas"), what="handover")
        assert pool["spec"]["replicas"] == 2
        # The HPA writes the pool's scale subresource.
        r = await client.patch(f"{POOL_PATH}/hpa-decode/scale", headers=MERGE,
                               params={"fieldManager": "kube-controller-manager"},
                               json={"spec": {"replicas": 5}})
        assert r.status_code == 200, r.text
        await eventually(lambda: (api.get("apps/v1/deployments", NAMESPACE, "hpa-decode")
                                or {}).get("spec", {}).get("replicas") == 5,
                         what="Deployment follows the HPA")
        await edit_model(client, "hpa", 8)
        await rolled_out(api, "hpa-decode", 8)
        await edit_model(client, "hpa", 16)
        await rolled_out(api, "hpa-decode", 16)
    async with running_operator():
        await resumed(api)
    pool = api.get(POOLS, NAMESPACE, "hpa-decode")
    assert pool["spec"]["replicas"] == 5
    # The handover re-applies the stored count each reconcile: equal values share the field.
    assert owners(pool, "spec", "replicas") <= {"kube-controller-manager", "kvpilot-handover"}
    assert "kube-controller-manager" in owners(pool, "spec", "replicas")
    assert api.get("apps/v1/deployments", NAMESPACE, "hpa-decode")["spec"]["replicas"] == 5
    assert not events(api, "FieldConflict")


async def test_switching_a_static_pool_to_external_keeps_its_replicas(api, operator, client):
    await client.post(IM_PATH, json=tiny("sw", decode={"replicas": 3}))
    await eventually(lambda: deployment_args(api, "sw-decode"), what="decode Deployment")
    assert owners(api.get(POOLS, NAMESPACE, "sw-decode"), "spec", "replicas") == {"kvpilot"}
    r = await client.patch(f"{IM_PATH}/sw", headers=MERGE, json={
        "spec": {"decode": {"autoscaling": {"mode": "external"}}}})
    assert r.status_code == 200, r.text
    pool = await eventually(lambda: (p := api.get(POOLS, NAMESPACE, "sw-decode"))
                            and "autoscaling" in p["spec"] and p, what="pool switched")
    assert pool["spec"]["replicas"] == 3
    assert owners(pool, "spec", "replicas") == {"kvpilot-handover"}
    assert api.get("apps/v1/deployments", NAMESPACE, "sw-decode")["spec"]["replicas"] == 3


async def test_a_conflict_on_an_owned_field_is_an_event_and_status_and_is_taken_back(
        api, operator, client):
    await client.post(IM_PATH, json=tiny("own"))
    await eventually(lambda: deployment_args(api, "own-decode"), what="decode Deployment")
    # Someone scales a static pool by hand: replicas are kvpilot's (no autoscaling block).
    r = await client.patch(f"{POOL_PATH}/own-decode", params=EDIT, headers=MERGE,
                           json={"spec": {"replicas": 4}})
    assert r.status_code == 200, r.text
    await edit_model(client, "own", 8)
    warning = await eventually(lambda: events(api, "FieldConflict"), what="FieldConflict event")
    assert warning[0]["type"] == "Warning"
    assert warning[0]["involvedObject"]["kind"] == "InferenceModel"
    message = warning[0]["message"]
    assert "DecodePool/own-decode: .spec.replicas (set by 'kubectl-edit')" in message
    assert "autoscaling.mode: external" in message
    assert api.get(POOLS, NAMESPACE, "own-decode")["spec"]["replicas"] == 1
    im = await eventually(lambda: (o := api.get(IMS, NAMESPACE, "own"))
                          and o["status"].get("fieldConflicts") and o, what="status")
    assert im["status"]["fieldConflicts"] == [
        {"object": "DecodePool/own-decode", "field": ".spec.replicas", "manager": "kubectl-edit"}]
    await edit_model(client, "own", 16)  # nothing drifted since: the status forgets it
    await eventually(lambda: "fieldConflicts" not in api.get(IMS, NAMESPACE, "own")["status"],
                     what="fieldConflicts cleared")
    assert len(events(api, "FieldConflict")) == 1


async def test_a_field_kvpilot_stops_rendering_is_removed(api, operator, client):
    await client.post(IM_PATH, json=tiny("rm", overrides={"annotations": {"example.com/a": "1"}}))

    def pod_annotations() -> dict[str, str]:
        deployment = api.get("apps/v1/deployments", NAMESPACE, "rm-decode") or {}
        template = (deployment.get("spec") or {}).get("template") or {}
        return (template.get("metadata") or {}).get("annotations") or {}

    await eventually(lambda: "example.com/a" in pod_annotations(), what="annotation rendered")
    r = await client.patch(f"{IM_PATH}/rm", headers=MERGE,
                           json={"spec": {"overrides": {"annotations": None}}})
    assert r.status_code == 200, r.text
    await eventually(lambda: pod_annotations() and "example.com/a" not in pod_annotations(),
                     what="annotation removed")
    pool = api.get(POOLS, NAMESPACE, "rm-decode")
    assert "example.com/a" not in (pool["spec"].get("overrides") or {}).get("annotations", {})
