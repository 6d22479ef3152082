"""What the operator renders for a model's security: NetworkPolicies, the fleet Secret and
the API key in engines and routers, default memory limits."""

from __future__ import annotations

from typing import Any

import pytest
from test_render_matrix import LLAMA_70B, render_all

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.render.children import owned_pools
from kvpilot.operator.render.fleet import fleet_secret
from kvpilot.operator.render.meta import RenderConfig
from kvpilot.operator.render.resources import engine_resources

TINY = {"model": {"name": "m", "source": "dummy:tiny-llama"}, "accelerator": {"vendor": "cpu"}}
CONFIG = RenderConfig(operator_namespace="kvpilot-system", metrics_namespaces=("monitoring",))
OPERATOR = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvpilot",
                                            "app.kubernetes.io/component": "operator"}},
            "namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": "kvpilot-system"}}}
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
ROUTER = {"podSelector": {"matchLabels": {"kvpilot.dev/model": "m",
                                          "app.kubernetes.io/component": "router"}}}
ENGINES = {"podSelector": {"matchLabels": {"kvpilot.dev/model": "m",
                                           "app.kubernetes.io/component": "engine"}}}


def policy(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(o["spec"] for o in objects
                if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == name)


def test_pool_policy_lets_in_router_operator_and_engines_only():
    objects = render_all({**TINY, "servingMode": "disaggregated", "prefill": {}}, CONFIG)
    for pool in ("m-prefill", "m-decode"):
        spec = policy(objects, pool)
        assert spec["podSelector"]["matchLabels"] == {"kvpilot.dev/model": "m",
                                                      "kvpilot.dev/pool": pool}
        assert spec["policyTypes"] == ["Ingress"]
        assert spec["ingress"] == [
            {"from": [ROUTER, OPERATOR, MONITORING], "ports": [{"protocol": "TCP",
                                                                "port": 8000}]},
            {"from": [ENGINES, ROUTER], "ports": [{"protocol": "TCP", "port": 9000}]},
        ]


def test_multi_node_groups_reach_each_other_on_every_port():
    objects = render_all({"model": LLAMA_70B, "topology": {"tensorParallel": 8,
                                                           "pipelineParallel": 2},
                          "accelerator": {"vendor": "nvidia"}}, RenderConfig())
    assert policy(objects, "m-decode")["ingress"][-1] == {"from": [{"podSelector": {
        "matchLabels": {"kvpilot.dev/model": "m", "kvpilot.dev/pool": "m-decode"}}}]}


@pytest.mark.parametrize(("allow_from", "expected"), [
    (None, [{"ports": [{"protocol": "TCP", "port": 8080}]}]),
    ([{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}],
     [{"ports": [{"protocol": "TCP", "port": 8080}],
       "from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}, OPERATOR,
                MONITORING]}]),
], ids=["anyone", "allow-from"])
def test_router_policy(allow_from, expected):
    router = {"allowFrom": allow_from} if allow_from else {}
    spec = policy(render_all({**TINY, "router": router}, CONFIG), "m-router")
    assert spec["podSelector"]["matchLabels"] == {"kvpilot.dev/model": "m",
                                                  "app.kubernetes.io/component": "router"}
    assert spec["ingress"] == expected


def test_pool_allow_from_adds_peers_to_the_http_port():
    objects = render_all({**TINY}, RenderConfig())
    assert policy(objects, "m-decode")["ingress"][0]["from"] == [ROUTER, {"podSelector": {
        "matchLabels": {"app.kubernetes.io/name": "kvpilot",
                        "app.kubernetes.io/component": "operator"}}}]


def test_api_key_reaches_engines_and_routers_only_as_a_secret_reference():
    objects = render_all({**TINY, "auth": {"apiKeySecretRef": {"name": "keys", "key": "k"}}},
                         RenderConfig())
    env = {"name": "KVPILOT_API_KEY",
           "valueFrom": {"secretKeyRef": {"name": "keys", "key": "k"}}}
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} == {"m-decode", "m-router"}
    for deployment in deployments:
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert env in container["env"]
        assert "--api-key" not in container["args"]
    pool = next(o for o in objects if o["kind"] == "DecodePool")
    assert pool["spec"]["auth"] == {"apiKeySecretRef": {"name": "keys", "key": "k"}}


def test_fleet_secret_is_random_per_render_and_named_after_the_model():
    owner = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
             "metadata": {"name": "m", "uid": "u"}}
    a, b = fleet_secret("m", "ns", owner), fleet_secret("m", "ns", owner)
    assert a["metadata"]["name"] == "m-fleet"
    assert len(a["stringData"]["secret"]) == 64 and a["stringData"] != b["stringData"]
    assert a["metadata"]["ownerReferences"][0]["uid"] == "u"


GIB = 2**30


@pytest.mark.parametrize(("spec", "limit", "memory_request"), [
    # 4 GiB runtime + tiny weights (0) + 256 MiB CPU KV (default) + 1 GiB shm -> 6 GiB
    (TINY, "6Gi", "2Gi"),
    # 4 GiB + 2 GiB KV cache + 1 GiB shm
    ({**TINY, "engine": {"kvCacheMemory": "2GiB"}}, "7Gi", "2Gi"),
    # 4 GiB + 70e9 params x 2 bytes (140 GB) + 32 GiB shm (8 GPUs x 4) on one pod
    ({"model": LLAMA_70B, "topology": {"tensorParallel": 8}, "accelerator": {
        "vendor": "nvidia", "model": "H100-80GB"}}, f"{4 + 131 + 32}Gi", "2Gi"),
    # unknown weights of an hf:// model: 32 GiB assumed; one GPU: 8 GiB shm
    ({"model": {"name": "x", "source": "hf://org/x"}, "accelerator": {"vendor": "nvidia"}},
     "44Gi", "2Gi"),
    # a memory request above the formula raises the limit to it
    ({**TINY, "overrides": {"resources": {"requests": {"memory": "20Gi"}}}}, "20Gi", "20Gi"),
    # a user limit wins; no default request may exceed it
    ({**TINY, "overrides": {"resources": {"limits": {"memory": "1Gi", "cpu": "500m"}}}},
     "1Gi", None),
], ids=["tiny", "kv-cache", "llama-70b-tp8", "unknown-weights", "request-above", "user-limit"])
def test_default_memory_limit(spec, limit, memory_request):
    parsed = InferenceModelSpec.model_validate(spec)
    (pool,) = owned_pools(parsed, "m")
    resources = engine_resources(pool.resolved)
    assert resources["limits"]["memory"] == limit
    assert resources["requests"].get("memory") == memory_request
    if memory_request is None:
        assert "cpu" not in resources["requests"]


def engine_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return next(o["spec"]["template"]["spec"] for o in objects
                if o["kind"] in ("Deployment", "StatefulSet")
                and o["spec"]["template"]["spec"]["containers"][0]["name"] == "engine")


def test_the_compile_cache_is_the_pods_own_unless_the_operator_names_a_node_directory():
    from pathlib import Path

    from kvpilot.operator.render.pods import TRITON_CACHE_DIR

    image = (Path(__file__).resolve().parents[2] / "images/engine-cuda.Dockerfile").read_text()
    assert f"TRITON_CACHE_DIR={TRITON_CACHE_DIR}" in image  # where the engine looks
    pod = engine_pod(render_all(TINY, RenderConfig()))
    assert not any("hostPath" in v for v in pod["volumes"])
    pod = engine_pod(render_all(TINY, RenderConfig(compile_cache_dir="/var/cache/kvpilot/c")))
    assert {"name": "compile-cache", "hostPath": {"path": "/var/cache/kvpilot/c",
                                                  "type": "DirectoryOrCreate"}} in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "compile-cache", "mountPath": TRITON_CACHE_DIR} in mounts
