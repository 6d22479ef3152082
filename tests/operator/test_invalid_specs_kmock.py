"""Every invalid manifest of tests/admission's table, sent past admission (the emulator has
none, as for objects created before a CRD upgrade), ends Degraded naming the problem, and
the operator applies none of its children."""

from __future__ import annotations

import sys
from pathlib import Path

from kube_api import ApiServer
from operator_harness import NAMESPACE, eventually

sys.path.insert(0, str(Path(__file__).parents[1] / "operator_api"))
sys.path.insert(0, str(Path(__file__).parents[1] / "admission"))
from invalid_manifests import CATEGORIES
from test_invalid_manifests import OPERATOR_ONLY

PLURALS = {"InferenceModel": "inferencemodels", "DecodePool": "decodepools",
           "PrefillPool": "prefillpools"}
CHILDREN = ("kvpilot.dev/v1alpha1/decodepools", "kvpilot.dev/v1alpha1/prefillpools",
            "apps/v1/deployments", "apps/v1/statefulsets", "v1/services", "v1/configmaps",
            "v1/secrets", "v1/serviceaccounts", "policy/v1/poddisruptionbudgets",
            "networking.k8s.io/v1/networkpolicies")


def degraded(obj: dict | None) -> dict | None:
    for cond in (obj or {}).get("status", {}).get("conditions", []):
        if cond["type"] == "Degraded" and cond["status"] == "True":
            return cond
    return None


async def test_every_invalid_manifest_ends_degraded_with_no_child(api: ApiServer, operator,
                                                                  client):
    sent = []
    for category, cases in CATEGORIES.items():
        for case_id, manifest, fragment in cases:
            if category != "names":  # one object per case: the table reuses names
                manifest = {**manifest, "metadata": {**manifest["metadata"],
                                                     "name": f"case{len(sent)}"}}
            path = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/{PLURALS[manifest['kind']]}"
            r = await client.post(path, json=manifest)
            assert r.status_code == 200, r.text
            sent.append((f"{category}/{case_id}", manifest, fragment))
    for where, manifest, fragment in sent:
        key = f"kvpilot.dev/v1alpha1/{PLURALS[manifest['kind']]}"
        name = manifest["metadata"]["name"]
        cond = await eventually(lambda k=key, n=name: degraded(api.get(k, NAMESPACE, n)),
                                timeout=60, what=f"{where} Degraded")
        assert cond["reason"] == "InvalidSpec", where
        if where in OPERATOR_ONLY:
            assert fragment in cond["message"], (where, cond["message"])
    for key in CHILDREN:  # the pools sent are objects of their own, never children
        assert [o for o in api.live(key, NAMESPACE)
                if o["metadata"].get("ownerReferences")] == [], key
