"""The fleet Secret on the emulator: created once per model under kvpilot's field manager,
never read, patched or overwritten, mounted by the engines and the router; a pool without
an InferenceModel gets its own."""

from __future__ import annotations

import yaml
from kube_api import ApiServer
from operator_harness import IMS, NAMESPACE, REPO, eventually
from test_reconcile_kmock import IM_PATH, MERGE, tiny

SECRETS = "v1/secrets"


def secret_volume(api: ApiServer, deployment: str) -> str | None:
    obj = api.get("apps/v1/deployments", NAMESPACE, deployment) or {}
    for volume in obj.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
        if "secret" in volume:
            return volume["secret"]["secretName"]
    return None


async def test_fleet_secret_is_created_once_and_kept(api: ApiServer, operator, client):
    await client.post(IM_PATH, json=tiny("fs"))
    secret = await eventually(lambda: api.get(SECRETS, NAMESPACE, "fs-fleet"), what="Secret")
    value = secret["stringData"]["secret"]
    assert len(value) == 64 and int(value, 16) >= 0
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "InferenceModel"
    assert [e["manager"] for e in secret["metadata"]["managedFields"]] == ["kvpilot"]
    await eventually(lambda: secret_volume(api, "fs-decode") == "fs-fleet", what="engines")
    assert secret_volume(api, "fs-router") == "fs-fleet"
    await client.patch(f"{IM_PATH}/fs", json={"spec": {"engine": {"maxNumSeqs": 8}}},
                       headers=MERGE)
    await eventually(lambda: (api.get(IMS, NAMESPACE, "fs") or {}).get("status", {})
                     .get("observedGeneration") == 2, what="second reconcile")
    assert api.get(SECRETS, NAMESPACE, "fs-fleet")["stringData"]["secret"] == value
    for action in ("fetch", "list", "watch", "update"):  # never read nor patched: created
        assert api.calls[action, "secrets"] == 0, action


async def test_a_pool_without_a_model_owns_its_fleet_secret(api: ApiServer, operator, client):
    pool = yaml.safe_load((REPO / "examples" / "decode-pool-standalone.yaml").read_text())
    pool["metadata"]["namespace"] = NAMESPACE
    await client.post(f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/decodepools",
                      json=pool)
    name = pool["metadata"]["name"]
    secret = await eventually(lambda: api.get(SECRETS, NAMESPACE, f"{name}-fleet"))
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "DecodePool"
    await eventually(lambda: secret_volume(api, name) == f"{name}-fleet", what="engines")
