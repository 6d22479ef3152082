"""The operator against the kmock emulator, with real engine processes behind a pool's pods.

The emulator runs no controllers, so the test plays the ReplicaSet: it keeps one
Ready pod (IP 127.0.0.1, port = an engine's) per `spec.replicas` and, on a
scale-down, deletes the pod with the lowest pod-deletion-cost as Kubernetes would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlparse

import httpx
from operator_harness import NAMESPACE, eventually

from kvpilot.engine.contracts.metric_names import ROUTER_PENDING_REQUESTS
from kvpilot.operator.autoscale.handler import PROMETHEUS_ENV
from kvpilot.operator.autoscale.pods import DELETION_COST
from kvpilot.operator.render.meta import POOL_LABEL
from kvpilot.operator.render.router import router_labels

POOLS = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/decodepools"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
MERGE = {"Content-Type": "application/merge-patch+json"}
POOL = "chat-decode"


def decode_pool() -> dict[str, Any]:
    """Gives an aggregated pool that scales on one waiting request per replica, fast windows."""
    return {
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "DecodePool",
        "metadata": {"name": POOL, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": "tiny-llama", "source": "dummy:tiny-llama"},
            "accelerator": {"vendor": "cpu"}, "replicas": 1, "role": "both",
            "autoscaling": {
                "minReplicas": 1, "maxReplicas": 2, "intervalSeconds": 1,
                "targets": {"queueDepthPerReplica": 1.0, "kvCacheUtilization": 0.95},
                "scaleUp": {"stabilizationWindowSeconds": 0, "maxReplicasPerPeriod": 1,
                            "periodSeconds": 1},
                "scaleDown": {"stabilizationWindowSeconds": 4, "maxReplicasPerPeriod": 1,
                              "periodSeconds": 1},
            },
        },
    }


def pod(index: int, port: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{POOL}-{index}", "namespace": NAMESPACE,
                         "labels": {POOL_LABEL: POOL}},
            "spec": {"containers": [{"name": "engine", "ports": [
                {"name": "http", "containerPort": port}]}]}}


READY = {"status": {"podIP": "127.0.0.1", "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True"}]}}


async def play_replicaset(client: httpx.AsyncClient, ports: list[int]) -> None:
    """Keeps the pool's pods in line with its spec.replicas, forever (cancel to stop)."""
    while True:
        replicas = (await client.get(f"{POOLS}/{POOL}")).json()["spec"]["replicas"]
        pods = (await client.get(PODS)).json()["items"]
        names = {p["metadata"]["name"] for p in pods}
        for i in range(replicas):
            if f"{POOL}-{i}" not in names:
                await client.post(PODS, json=pod(i, ports[i]))
                await client.patch(f"{PODS}/{POOL}-{i}/status", json=READY, headers=MERGE)
        if len(pods) > replicas:
            def cost(p: dict[str, Any]) -> tuple[int, str]:
                annotations = p["metadata"].get("annotations") or {}
                return int(annotations.get(DELETION_COST, 0)), p["metadata"]["name"]
            for victim in sorted(pods, key=cost)[: len(pods) - replicas]:
                await client.delete(f"{PODS}/{victim['metadata']['name']}")
        await asyncio.sleep(0.2)


async def spec_replicas(client: httpx.AsyncClient) -> int:
    return (await client.get(f"{POOLS}/{POOL}")).json()["spec"]["replicas"]


async def load(port: int, n: int) -> list[asyncio.Task[Any]]:
    """Starts n long completions on one engine; gives the tasks (cancel them to stop)."""
    http = httpx.AsyncClient(timeout=120)

    async def one() -> None:
        with contextlib.suppress(httpx.HTTPError):
            await http.post(f"http://127.0.0.1:{port}/v1/completions", json={
                "model": "tiny-llama", "prompt": "hello " * 20, "max_tokens": 1500,
                "ignore_eos": True})

    return [asyncio.create_task(one()) for _ in range(n)]


class _Quiet(BaseHTTPRequestHandler):
    """A handler that answers 200 with a body and logs nothing."""

    def answer(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


class _RouterMetrics(_Quiet):
    """A router's /metrics holding three decode requests for a pool with no replica."""

    def do_GET(self) -> None:
        self.answer((f"# TYPE {ROUTER_PENDING_REQUESTS} gauge\n"
                     f'{ROUTER_PENDING_REQUESTS}{{role="both"}} 3.0\n').encode(), "text/plain")


async def test_router_demand_scales_a_pool_from_zero(api, operator, client) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RouterMetrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        router = {"apiVersion": "v1", "kind": "Pod",
                  "metadata": {"name": "zero-router-0", "namespace": NAMESPACE,
                               "labels": router_labels("zero-decode")},
                  "spec": {"containers": [{"name": "router", "ports": [
                      {"name": "http", "containerPort": server.server_address[1]}]}]}}
        await client.post(PODS, json=router)
        await client.patch(f"{PODS}/zero-router-0/status", json=READY, headers=MERGE)
        pool = decode_pool()
        pool["metadata"]["name"] = "zero-decode"
        pool["spec"]["replicas"] = 0
        pool["spec"]["autoscaling"]["minReplicas"] = 0
        assert (await client.post(POOLS, json=pool)).status_code == 200
        got = await eventually(lambda: _scaled_from_zero(client), timeout=120,
                               what="zero-decode at 1 replica")
        assert got["status"]["lastScaleDecision"]["reason"].startswith(
            "router holds 3 requests for a pool with no ready replica")
    finally:
        server.shutdown()


async def _scaled_from_zero(client: httpx.AsyncClient) -> dict[str, Any] | None:
    # spec.replicas and the status are two patches: wait for both.
    pool = (await client.get(f"{POOLS}/zero-decode")).json()
    decided = pool.get("status", {}).get("lastScaleDecision")
    return pool if pool["spec"]["replicas"] == 1 and decided else None


class _Prometheus(_Quiet):
    """A Prometheus query API: one pod of the pool, 40 requests waiting."""

    ANSWERS: ClassVar[dict[str, float]] = {
        "avg(vllm:kv": 0.5, "sum(vllm:num_requests_waiting": 40.0,
        "sum(vllm:num_requests_running": 2.0, "sum(kvpilot_num_waiting": 800.0, "count(": 1.0}
    queries: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        query = parse_qs(urlparse(self.path).query)["query"][0]
        self.queries.append(query)
        value = next(v for k, v in self.ANSWERS.items() if query.startswith(k))
        self.answer(json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {}, "value": [0, str(value)]}]}}).encode(), "application/json")


async def test_prometheus_source_drives_the_pool(api, operator, client, monkeypatch) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Prometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv(PROMETHEUS_ENV, f"http://127.0.0.1:{server.server_address[1]}")
    try:
        pool = decode_pool()
        pool["metadata"]["name"] = "prom-decode"
        assert (await client.post(POOLS, json=pool)).status_code == 200
        got = await eventually(lambda: _replicas_of(client, "prom-decode", 2), timeout=120,
                               what="prom-decode at 2 replicas")
        assert got["status"]["lastScaleDecision"]["reason"].startswith(
            "queueDepthPerReplica 40 vs target 1")
        assert 'namespace="default",pod=~"prom-decode-.*"' in _Prometheus.queries[0]
    finally:
        server.shutdown()


async def _replicas_of(client: httpx.AsyncClient, name: str, n: int) -> dict[str, Any] | None:
    # spec.replicas and the status are two patches: wait for both.
    pool = (await client.get(f"{POOLS}/{name}")).json()
    decided = pool.get("status", {}).get("lastScaleDecision", {}).get("toReplicas") == n
    return pool if pool["spec"]["replicas"] == n and decided else None


IMS = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/inferencemodels"


async def test_model_gpu_budget_holds_the_pool_and_status_rolls_up(
        api, operator, client: httpx.AsyncClient, engines) -> None:
    """An InferenceModel with gpuBudget 1: load asks for a second replica, the budget says no,
    and the model's status shows KV%, QUEUE and the held decision."""
    autoscaling = decode_pool()["spec"]["autoscaling"]
    im = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
          "metadata": {"name": "chat", "namespace": NAMESPACE},
          "spec": {"model": {"name": "chat", "source": "dummy:tiny-llama"},
                   "accelerator": {"vendor": "cpu"}, "gpuBudget": 1,
                   "decode": {"replicas": 1, "autoscaling": autoscaling}}}
    assert (await client.post(IMS, json=im)).status_code == 200, "InferenceModel rejected"
    await eventually(lambda: _exists(client, f"{POOLS}/{POOL}"), timeout=120,
                     what="the model's decode pool")
    ports = [port for port, _ in engines]
    replicaset = asyncio.create_task(play_replicaset(client, ports))
    tasks = await load(ports[0], 8)
    try:
        status = await eventually(lambda: _model_decision(client), timeout=120,
                                  what="the model's lastScaleDecision")
        decision = status["lastScaleDecision"]
        assert (decision["pool"], decision["fromReplicas"], decision["toReplicas"]) == \
            (POOL, 1, 1)
        assert "GPU budget 1 binds: chat-decode 1 of 2 wanted" in decision["reason"]
        assert status["queueDepth"] >= 1 and 0 <= status["kvCachePercent"] <= 100
        # The decision is an Event on the model as well as on the pool.
        await eventually(lambda: _model_event(client, "ScaleHeld"), timeout=60,
                         what="a ScaleHeld event on the InferenceModel")
        await asyncio.sleep(3)
        assert await spec_replicas(client) == 1
    finally:
        for t in tasks:
            t.cancel()
        replicaset.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await replicaset
        await client.delete(f"{IMS}/chat")
        await client.delete(f"{POOLS}/{POOL}")
        for i in range(2):
            await client.delete(f"{PODS}/{POOL}-{i}")


async def _exists(client: httpx.AsyncClient, path: str) -> bool:
    return (await client.get(path)).status_code == 200


async def _model_decision(client: httpx.AsyncClient) -> dict[str, Any] | None:
    status = (await client.get(f"{IMS}/chat")).json().get("status") or {}
    return status if "lastScaleDecision" in status and "queueDepth" in status else None


async def test_load_scales_up_idleness_scales_down_dead_metrics_freeze(
        api, operator, client: httpx.AsyncClient, engines) -> None:
    ports = [port for port, _ in engines]
    assert (await client.post(POOLS, json=decode_pool())).status_code == 200
    replicaset = asyncio.create_task(play_replicaset(client, ports))
    try:
        # Load: 8 requests on an engine that runs 2 at a time leaves 6 waiting.
        tasks = await load(ports[0], 8)
        await eventually(lambda: _replicas_at_least(client, 2), timeout=120,
                         what="scale-up to 2")
        pool = (await client.get(f"{POOLS}/{POOL}")).json()
        decision = pool["status"]["lastScaleDecision"]
        assert (decision["fromReplicas"], decision["toReplicas"]) == (1, 2)
        assert decision["reason"].startswith("queueDepthPerReplica")
        assert pool["status"]["queueDepth"] >= 1
        assert "kvCachePercent" in pool["status"]
        for t in tasks:
            t.cancel()

        # Idle: back to 1 once the 4 s window has passed; the idle pod was marked first.
        start = time.monotonic()
        await eventually(lambda: _replicas_at_most(client, 1), timeout=120,
                         what="scale-down to 1")
        assert time.monotonic() - start >= 3.5
        decision = (await client.get(f"{POOLS}/{POOL}")).json()["status"]["lastScaleDecision"]
        assert (decision["fromReplicas"], decision["toReplicas"]) == (2, 1)
        await eventually(lambda: _event_reasons(client, {"ScaledUp", "ScaledDown"}),
                         timeout=60, what="ScaledUp and ScaledDown events")

        # A dead metrics endpoint: two replicas, one engine killed, idle load.
        engines[1][1].kill()
        engines[1][1].wait(10)
        await client.patch(f"{POOLS}/{POOL}", json={"spec": {"replicas": 2}}, headers=MERGE)
        await eventually(lambda: _pods(client, 2), timeout=60, what="two pods")
        await asyncio.sleep(9)  # more than twice the scale-down window
        assert await spec_replicas(client) == 2
        status = (await client.get(f"{POOLS}/{POOL}")).json()["status"]
        assert "missing data (1/2 replicas reported metrics)" in \
            status["lastScaleDecision"]["reason"]
    finally:
        replicaset.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await replicaset


async def _replicas_at_least(client: httpx.AsyncClient, n: int) -> bool:
    # spec.replicas and the status are two patches: wait for the decision too.
    pool = (await client.get(f"{POOLS}/{POOL}")).json()
    decided = pool.get("status", {}).get("lastScaleDecision", {}).get("toReplicas", 0) >= n
    return pool["spec"]["replicas"] >= n and decided


async def _replicas_at_most(client: httpx.AsyncClient, n: int) -> bool:
    pool = (await client.get(f"{POOLS}/{POOL}")).json()
    decided = pool.get("status", {}).get("lastScaleDecision", {}).get("toReplicas", n + 1) <= n
    return pool["spec"]["replicas"] <= n and decided


async def _pods(client: httpx.AsyncClient, n: int) -> bool:
    return len((await client.get(PODS)).json()["items"]) == n


async def _event_reasons(client: httpx.AsyncClient, wanted: set[str]) -> bool:
    events = (await client.get(f"/api/v1/namespaces/{NAMESPACE}/events")).json()["items"]
    return wanted <= {e.get("reason") for e in events}


async def _model_event(client: httpx.AsyncClient, reason: str) -> bool:
    events = (await client.get(f"/api/v1/namespaces/{NAMESPACE}/events")).json()["items"]
    return any(e.get("reason") == reason and e["involvedObject"]["kind"] == "InferenceModel"
               and e["message"].startswith(f"{POOL}: 1 -> 1 replicas: ") for e in events)
