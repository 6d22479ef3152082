"""spec.adapters through the real kopf operator on the kmock emulator: the engine pods of the
decode pool get the adapters' init container, volumes and `--enable-lora` flags, and an
edit of the adapters rolls them (the LoRA flags faked as the engine's, see
test_render_adapters); while the engine lacks them the model is refused, naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.lora_engine import fake_lora_engine
from kube_api import ApiServer
from operator_harness import IMS, NAMESPACE, eventually
from test_reconcile_kmock import IM_PATH, MERGE, tiny

from kvpilot.operator.render.adapters import engine_serves_lora

DEPLOYMENTS = "apps/v1/deployments"
SQL = {"name": "sql", "source": "hf://acme/sql-lora"}
LAW = {"name": "law", "source": "pvc://loras/law"}


def engine_pod(api: ApiServer, name: str) -> dict[str, Any] | None:
    deployment = api.get(DEPLOYMENTS, NAMESPACE, name)
    return deployment["spec"]["template"]["spec"] if deployment else None


def lora_flags(pod: dict[str, Any]) -> list[str]:
    args = pod["containers"][0]["args"]
    return args[args.index("--enable-lora"):] if "--enable-lora" in args else []


async def test_adapters_reach_the_engine_pods_and_an_edit_rolls_them(
        api, operator, client, monkeypatch: pytest.MonkeyPatch):
    fake_lora_engine(monkeypatch)
    assert (await client.post(IM_PATH, json=tiny("chat", adapters=[SQL]))).status_code == 200
    pod = await eventually(lambda: engine_pod(api, "chat-decode"), what="decode Deployment")
    assert lora_flags(pod) == ["--enable-lora", "--lora-modules", "sql=/adapters/sql",
                               "--max-loras", "1"]
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-adapter-sql"]
    r = await client.patch(f"{IM_PATH}/chat", headers=MERGE,
                           json={"spec": {"adapters": [SQL, LAW], "engine": {"maxLoras": 2}}})
    assert r.status_code == 200, r.text
    pod = await eventually(lambda: (p := engine_pod(api, "chat-decode"))
                           and "law=/adapter-claims/loras/law" in lora_flags(p) and p,
                           what="the Deployment re-rendered with the second adapter")
    assert lora_flags(pod)[-2:] == ["--max-loras", "2"]
    assert {"name": "adapter-claim-0", "persistentVolumeClaim": {
        "claimName": "loras", "readOnly": True}} in pod["volumes"]


async def test_refused_while_the_engine_has_no_lora(api, operator, client):
    if engine_serves_lora():
        pytest.skip("this checkout's engine takes --enable-lora")
    assert (await client.post(IM_PATH, json=tiny("chat", adapters=[SQL]))).status_code == 200

    def degraded() -> dict[str, Any] | None:
        conditions = ((api.get(IMS, NAMESPACE, "chat") or {}).get("status") or {}).get(
            "conditions", [])
        return next((c for c in conditions if c["type"] == "Degraded"
                     and c["status"] == "True"), None)

    condition = await eventually(degraded, what="Degraded")
    assert condition["reason"] == "InvalidSpec"
    assert "spec.adapters=['sql']: this kvpilot's engine has no LoRA flags" in condition["message"]
    assert api.get(DEPLOYMENTS, NAMESPACE, "chat-decode") is None
