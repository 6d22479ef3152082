"""The real kopf operator against the kmock API emulator over HTTP."""

from __future__ import annotations

from typing import Any

import httpx
import yaml
from kube_api import ApiServer
from operator_harness import IMS, NAMESPACE, REPO, eventually, running_operator

IM_PATH = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/inferencemodels"
MERGE = {"Content-Type": "application/merge-patch+json"}


def tiny(name: str, **spec: Any) -> dict[str, Any]:
    """Gives an InferenceModel manifest serving the built-in tiny model on CPU."""
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"model": {"name": name, "source": "dummy:tiny-llama"},
                     "accelerator": {"vendor": "cpu"}, **spec}}


def kinds(api: ApiServer) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key in ("kvpilot.dev/v1alpha1/decodepools", "kvpilot.dev/v1alpha1/prefillpools",
                "apps/v1/deployments", "apps/v1/statefulsets", "v1/services",
                "v1/configmaps", "policy/v1/poddisruptionbudgets"):
        for obj in api.live(key, NAMESPACE):
            out.setdefault(obj["kind"], []).append(obj["metadata"]["name"])
    return {k: sorted(v) for k, v in out.items()}


async def test_aggregated_model_gets_children_and_status(api, operator, client: httpx.AsyncClient):
    r = await client.post(IM_PATH, json=tiny("chat"))
    assert r.status_code == 200, r.text
    im = await eventually(lambda: (o := api.get(IMS, NAMESPACE, "chat"))
                          and o.get("status", {}).get("observedGeneration") == 1 and o,
                          what="InferenceModel status")
    await eventually(lambda: api.get("apps/v1/deployments", NAMESPACE, "chat-decode"),
                     what="decode Deployment")
    assert kinds(api) == {
        "DecodePool": ["chat-decode"],
        "Deployment": ["chat-decode", "chat-router"],
        "Service": ["chat-decode", "chat-router"],
        "ConfigMap": ["chat-engine"],
        "PodDisruptionBudget": ["chat-decode"],
    }
    pool = api.get("kvpilot.dev/v1alpha1/decodepools", NAMESPACE, "chat-decode")
    assert pool["spec"]["role"] == "both"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == im["metadata"]["uid"]
    deployment = api.get("apps/v1/deployments", NAMESPACE, "chat-decode")
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:4] == ["--model", "tiny-llama", "--served-model-name", "chat"]
    status = im["status"]
    assert status["endpoint"] == f"http://chat-router.{NAMESPACE}.svc:8080/v1"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "False", "Progressing": "True", "Degraded": "False"}
    assert status["decodeReplicas"] == "0/1"


async def test_disaggregated_model_gets_prefill_and_decode_pools(api, operator, client):
    r = await client.post(IM_PATH, json=tiny("split", servingMode="disaggregated",
                                             prefill={"replicas": 2}))
    assert r.status_code == 200, r.text
    await eventually(lambda: api.get("apps/v1/deployments", NAMESPACE, "split-prefill")
                     and api.get("apps/v1/deployments", NAMESPACE, "split-decode"),
                     what="both pool Deployments")
    prefill = api.get("kvpilot.dev/v1alpha1/prefillpools", NAMESPACE, "split-prefill")
    decode = api.get("kvpilot.dev/v1alpha1/decodepools", NAMESPACE, "split-decode")
    assert (prefill["spec"]["role"], decode["spec"]["role"]) == ("prefill", "decode")
    deployment = api.get("apps/v1/deployments", NAMESPACE, "split-prefill")
    assert deployment["spec"]["replicas"] == 2
    assert "--role" in (args := deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args[args.index("--role") + 1] == "prefill"
    im = await eventually(lambda: (o := api.get(IMS, NAMESPACE, "split"))
                          and o.get("status", {}).get("prefillReplicas") and o)
    assert (im["status"]["prefillReplicas"], im["status"]["decodeReplicas"]) == ("0/2", "0/1")


def conditions(obj: dict[str, Any] | None) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (obj or {}).get("status", {}).get("conditions", [])}


def deployment_args(api: ApiServer, name: str) -> list[str]:
    obj = api.get("apps/v1/deployments", NAMESPACE, name)
    return obj["spec"]["template"]["spec"]["containers"][0]["args"] if obj else []


async def test_changing_tensor_parallel_updates_pool_and_deployment(api, operator, client):
    await client.post(IM_PATH, json=tiny("tp"))
    await eventually(lambda: deployment_args(api, "tp-decode"), what="decode Deployment")
    assert "--tensor-parallel-size" not in deployment_args(api, "tp-decode")
    r = await client.patch(f"{IM_PATH}/tp", json={"spec": {"topology": {"tensorParallel": 2}}},
                           headers=MERGE)
    assert r.status_code == 200, r.text
    args = await eventually(lambda: (a := deployment_args(api, "tp-decode"))
                            and "--tensor-parallel-size" in a and a, what="TP=2 rollout")
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    pool = api.get("kvpilot.dev/v1alpha1/decodepools", NAMESPACE, "tp-decode")
    assert pool["spec"]["topology"]["tensorParallel"] == 2
    assert pool["metadata"]["generation"] == 2
    im = await eventually(lambda: (o := api.get(IMS, NAMESPACE, "tp"))
                          and o["status"].get("observedGeneration") == 2 and o)
    assert conditions(im)["Degraded"] == "False"


async def test_invalid_spec_ends_degraded_with_the_field_named(api, operator, client):
    manifest = tiny("bad", topology={"tensorParallel": 3})
    manifest["spec"]["model"].update(numAttentionHeads=32, numKeyValueHeads=8)
    await client.post(IM_PATH, json=manifest)
    im = await eventually(lambda: (o := api.get(IMS, NAMESPACE, "bad"))
                          and o.get("status", {}).get("observedGeneration") == 1 and o,
                          what="Degraded status")
    assert conditions(im) == {"Ready": "False", "Progressing": "False", "Degraded": "True"}
    degraded = next(c for c in im["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "topology.tensorParallel=3" in degraded["message"]
    assert api.live("kvpilot.dev/v1alpha1/decodepools", NAMESPACE) == []
    # Fixing the spec recovers without an operator restart.
    await client.patch(f"{IM_PATH}/bad", json={"spec": {"topology": {"tensorParallel": 4}}},
                       headers=MERGE)
    im = await eventually(lambda: (o := api.get(IMS, NAMESPACE, "bad"))
                          and conditions(o).get("Degraded") == "False" and o, what="recovery")
    assert im["status"]["observedGeneration"] == 2


async def test_ready_counts_roll_up_from_deployment_to_model(api, operator, client):
    await client.post(IM_PATH, json=tiny("up"))
    await eventually(lambda: api.get("apps/v1/deployments", NAMESPACE, "up-decode"))
    await eventually(lambda: conditions(api.get(IMS, NAMESPACE, "up")).get("Ready") == "False")
    # Play the Deployment controller: one replica became ready.
    r = await client.patch(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/up-decode/status",
                           json={"status": {"replicas": 1, "readyReplicas": 1}}, headers=MERGE)
    assert r.status_code == 200, r.text
    im = await eventually(lambda: (o := api.get(IMS, NAMESPACE, "up"))
                          and conditions(o).get("Ready") == "True" and o, what="Ready=True")
    assert im["status"]["decodeReplicas"] == "1/1"
    pool = api.get("kvpilot.dev/v1alpha1/decodepools", NAMESPACE, "up-decode")
    assert (pool["status"]["replicas"], pool["status"]["readyReplicas"]) == (1, 1)
    assert pool["status"]["selector"] == "kvpilot.dev/model=up,kvpilot.dev/pool=up-decode"


async def test_scaling_a_pool_scales_its_deployment(api, operator, client):
    await client.post(IM_PATH, json=tiny("sc"))
    await eventually(lambda: api.get("apps/v1/deployments", NAMESPACE, "sc-decode"))
    await client.patch(f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/decodepools/sc-decode",
                       json={"spec": {"replicas": 3}}, headers=MERGE)
    await eventually(lambda: api.get("apps/v1/deployments", NAMESPACE, "sc-decode")["spec"]
                     ["replicas"] == 3, what="Deployment replicas 3")


def census(api: ApiServer) -> list[tuple[str, str, int]]:
    """Gives (kind, name, owner-reference count) of every live object the operator made."""
    out = []
    for key in ("kvpilot.dev/v1alpha1/decodepools", "kvpilot.dev/v1alpha1/prefillpools",
                "apps/v1/deployments", "v1/services", "v1/configmaps", "v1/serviceaccounts",
                "rbac.authorization.k8s.io/v1/roles", "rbac.authorization.k8s.io/v1/rolebindings",
                "policy/v1/poddisruptionbudgets"):
        for obj in api.live(key, NAMESPACE):
            out.append((obj["kind"], obj["metadata"]["name"],
                        len(obj["metadata"].get("ownerReferences", []))))
    return sorted(out)


async def test_restart_mid_reconcile_leaves_no_duplicates(api, client):
    await client.post(IM_PATH, json=tiny("rs", servingMode="disaggregated", prefill={}))
    async with running_operator():
        # Stop the operator as soon as the first child exists: the model's handler is
        # somewhere in the middle of applying the rest.
        await eventually(lambda: api.live("kvpilot.dev/v1alpha1/prefillpools", NAMESPACE),
                         timeout=20, what="first child")
    partial = census(api)
    async with running_operator():
        await eventually(lambda: (o := api.get(IMS, NAMESPACE, "rs"))
                         and o.get("status", {}).get("observedGeneration") == 1,
                         what="status after restart")
        await eventually(lambda: len(census(api)) == 14, what="all children")
        full = census(api)
    assert set(partial) <= set(full)
    assert full == [
        ("ConfigMap", "rs-engine", 1),
        ("DecodePool", "rs-decode", 1),
        ("Deployment", "rs-decode", 1),
        ("Deployment", "rs-prefill", 1),
        ("Deployment", "rs-router", 1),
        ("PodDisruptionBudget", "rs-decode", 1),
        ("PodDisruptionBudget", "rs-prefill", 1),
        ("PrefillPool", "rs-prefill", 1),
        ("Role", "rs-router", 1),
        ("RoleBinding", "rs-router", 1),
        ("Service", "rs-decode", 1),
        ("Service", "rs-prefill", 1),
        ("Service", "rs-router", 1),
        ("ServiceAccount", "rs-router", 1),
    ]
    async with running_operator():  # a third start (resume) changes nothing
        await eventually(lambda: True)
        assert census(api) == full


async def test_standalone_pool_from_the_example_gets_its_workload(api, operator, client):
    pool = yaml.safe_load((REPO / "examples" / "decode-pool-standalone.yaml").read_text())
    pool["metadata"]["namespace"] = NAMESPACE
    r = await client.post(f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/decodepools",
                          json=pool)
    assert r.status_code == 200, r.text
    name = pool["metadata"]["name"]
    deployment = await eventually(lambda: api.get("apps/v1/deployments", NAMESPACE, name),
                                  what="standalone pool Deployment")
    assert deployment["spec"]["replicas"] == 2
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:4] == ["--model", "tiny-qwen3", "--served-model-name", "tiny-qwen3"]
    stored = await eventually(lambda: (o := api.get("kvpilot.dev/v1alpha1/decodepools",
                                                    NAMESPACE, name))
                              and o.get("status", {}).get("observedGeneration") and o)
    assert stored["status"]["selector"] == f"kvpilot.dev/model={name},kvpilot.dev/pool={name}"
    assert stored["status"]["replicas"] == 2


async def test_switching_to_aggregated_prunes_the_prefill_pool_and_delete_cascades(
        api, operator, client):
    await client.post(IM_PATH, json=tiny("sw", servingMode="disaggregated", prefill={}))
    await eventually(lambda: api.get("apps/v1/deployments", NAMESPACE, "sw-prefill"),
                     what="prefill Deployment")
    r = await client.patch(f"{IM_PATH}/sw", headers=MERGE, json={
        "spec": {"servingMode": "aggregated", "prefill": None}})
    assert r.status_code == 200, r.text
    await eventually(lambda: not api.live("kvpilot.dev/v1alpha1/prefillpools", NAMESPACE),
                     what="PrefillPool pruned")
    # Garbage collection (emulated here by owner uid) takes the pool's Deployment with it.
    await eventually(lambda: api.get("apps/v1/deployments", NAMESPACE, "sw-prefill") is None)
    pool = await eventually(lambda: (o := api.get("kvpilot.dev/v1alpha1/decodepools",
                                                  NAMESPACE, "sw-decode"))
                            and o["spec"]["role"] == "both" and o, what="decode role both")
    assert pool["metadata"]["generation"] == 2
    deployment = await eventually(
        lambda: (d := api.get("apps/v1/deployments", NAMESPACE, "sw-decode"))
        and d["spec"]["template"]["metadata"]["labels"]["kvpilot.dev/role"] == "both" and d)
    # Selectors are immutable in Kubernetes: the role change must not touch them.
    assert deployment["spec"]["selector"]["matchLabels"] == {
        "kvpilot.dev/model": "sw", "kvpilot.dev/pool": "sw-decode"}
    await client.delete(f"{IM_PATH}/sw")
    await eventually(lambda: not census(api), what="every child collected")


async def test_emulator_rejects_selector_changes_like_the_api_server(api, client):
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
    body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
            "spec": {"selector": {"matchLabels": {"a": "1"}}, "replicas": 1}}
    assert (await client.post(path, json=body)).status_code == 200
    ok = await client.patch(f"{path}/d", json={"spec": {"replicas": 2}}, headers=MERGE)
    assert ok.status_code == 200 and ok.json()["metadata"]["generation"] == 2
    bad = await client.patch(f"{path}/d", headers=MERGE,
                             json={"spec": {"selector": {"matchLabels": {"a": "2"}}}})
    assert bad.status_code == 422 and "immutable" in bad.json()["message"]


async def test_engine_settings_reach_the_pool_deployment(api, operator, client):
    await client.post(IM_PATH, json=tiny("en"))
    await eventually(lambda: deployment_args(api, "en-decode"), what="decode Deployment")
    assert "--max-num-seqs" not in deployment_args(api, "en-decode")
    await client.patch(f"{IM_PATH}/en", json={"spec": {"engine": {"maxNumSeqs": 8}}},
                       headers=MERGE)
    args = await eventually(lambda: (a := deployment_args(api, "en-decode"))
                            and "--max-num-seqs" in a and a, what="engine change rolled out")
    assert args[args.index("--max-num-seqs") + 1] == "8"


async def test_multi_node_replicas_are_statefulset_groups_pruned_on_scale_down(
        api, operator, client):
    manifest = tiny("mn", topology={"tensorParallel": 8, "pipelineParallel": 2},
                    accelerator={"vendor": "nvidia"}, decode={"replicas": 2})
    await client.post(IM_PATH, json=manifest)
    sets = "apps/v1/statefulsets"
    await eventually(lambda: len(api.live(sets, NAMESPACE)) == 2, what="two groups")
    group = api.get(sets, NAMESPACE, "mn-decode-g0")
    assert (group["spec"]["replicas"], group["spec"]["serviceName"]) == (2, "mn-decode-workers")
    # The Services are applied after the groups: wait for them too.
    workers = await eventually(lambda: api.get("v1/services", NAMESPACE, "mn-decode-workers"),
                               what="rendezvous Service")
    assert workers["spec"]["clusterIP"] == "None"
    # Play the StatefulSet controller once the pool's handler has written its status: a
    # change during the handler is counted only by the next event or the pools' 30 s timer.
    await eventually(lambda: (api.get("kvpilot.dev/v1alpha1/decodepools", NAMESPACE,
                                      "mn-decode") or {}).get("status", {})
                     .get("observedGeneration"), what="the pool handled")
    # Rank 0 of one group becomes ready with its worker: one replica of two is ready.
    await client.patch(f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/mn-decode-g0/status",
                       json={"status": {"readyReplicas": 2}}, headers=MERGE)
    await eventually(lambda: api.get(IMS, NAMESPACE, "mn").get("status", {})
                     .get("decodeReplicas") == "1/2", what="1/2 ready")
    await client.patch(f"{IM_PATH}/mn", json={"spec": {"decode": {"replicas": 1}}},
                       headers=MERGE)
    await eventually(lambda: [s["metadata"]["name"] for s in api.live(sets, NAMESPACE)]
                     == ["mn-decode-g0"], what="group g1 pruned")
    await eventually(lambda: api.get(IMS, NAMESPACE, "mn")["status"].get("decodeReplicas")
                     == "1/1", what="1/1 ready")


async def test_a_degraded_pool_shows_on_its_model(api, operator, client):
    await client.post(IM_PATH, json=tiny("dg"))
    await eventually(lambda: conditions(api.get(IMS, NAMESPACE, "dg")).get("Ready") == "False")
    pool_status = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/decodepools/dg-decode/status"
    broken = [{"type": "Degraded", "status": "True", "reason": "ApplyRejected",
               "message": "spec.template: Invalid"}]
    await client.patch(pool_status, json={"status": {"conditions": broken}}, headers=MERGE)
    im = await eventually(lambda: (o := api.get(IMS, NAMESPACE, "dg"))
                          and conditions(o).get("Degraded") == "True" and o, what="PoolDegraded")
    degraded = next(c for c in im["status"]["conditions"] if c["type"] == "Degraded")
    assert (degraded["reason"], degraded["message"]) == (
        "PoolDegraded", "dg-decode: spec.template: Invalid")
    fixed = [{"type": "Degraded", "status": "False", "reason": "SpecValid", "message": ""}]
    await client.patch(pool_status, json={"status": {"conditions": fixed}}, headers=MERGE)
    await eventually(lambda: conditions(api.get(IMS, NAMESPACE, "dg")).get("Degraded") == "False",
                     what="recovery")
