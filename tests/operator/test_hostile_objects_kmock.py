"""One object cannot stall the operator: hostile pools next to 100 valid models.

The hostile objects: a DecodePool of 100,000,000 two-node replicas (issue 18: the handler
rendered StatefulSets synchronously in kopf's loop, 620 MB in 13 s, and the next model was
never reconciled), one of 1,000 two-node replicas (16,000 GPUs, over --max-pool-gpus), and
the largest pool the operator does render (256 two-node replicas = 4,096 GPUs). All valid
models must still become Ready within the usual time and the process's memory stay bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import psutil
from kube_api import ApiServer
from operator_harness import IMS, NAMESPACE, eventually

VALID = 100
POOLS = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/decodepools"
MODELS = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/inferencemodels"
MERGE = {"Content-Type": "application/merge-patch+json"}
TWO_NODES = {"topology": {"tensorParallel": 8, "pipelineParallel": 2},
             "accelerator": {"vendor": "nvidia"}}
RSS_GROWTH_LIMIT = 400 * 2**20


def pool(name: str, replicas: int) -> dict:
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "DecodePool",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"model": {"name": name, "source": "dummy:tiny-llama"},
                     "replicas": replicas, **TWO_NODES}}


def model(i: int) -> dict:
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": f"m{i:03d}", "namespace": NAMESPACE},
            "spec": {"model": {"name": f"m{i}", "source": "dummy:tiny-llama"},
                     "accelerator": {"vendor": "cpu"}, "router": {"replicas": 0}}}


class PeakRss:
    """Samples this process's RSS in a thread (it keeps sampling while the loop is busy)."""

    def __init__(self) -> None:
        self.start = psutil.Process().memory_info().rss
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        process = psutil.Process()
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, process.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.start


def ready(api: ApiServer, name: str) -> bool:
    im = api.get(IMS, NAMESPACE, name) or {}
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in im.get("status", {}).get("conditions", []))


async def play_deployment_controller(api: ApiServer, client) -> None:
    """Marks every engine Deployment ready, as the Deployment controller would."""
    done: set[str] = set()
    while True:
        for obj in api.live("apps/v1/deployments", NAMESPACE):
            name = obj["metadata"]["name"]
            pool = api.get("kvpilot.dev/v1alpha1/decodepools", NAMESPACE, name) or {}
            # Once the pool's handler wrote its status, workload events roll up (a real
            # controller keeps updating; this one patches once).
            handled = pool.get("status", {}).get("observedGeneration")
            if name not in done and name.startswith("m") and handled:
                replicas = obj["spec"]["replicas"]
                await client.patch(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}/"
                                   "status", headers=MERGE, json={"status": {
                                       "replicas": replicas, "readyReplicas": replicas}})
                done.add(name)
        await asyncio.sleep(0.2)


async def test_hostile_pools_do_not_stall_valid_models(api: ApiServer, operator, client):
    rss = PeakRss()
    started = time.monotonic()
    for name, replicas in (("huge", 100_000_000), ("over-gpus", 1000), ("largest", 256)):
        assert (await client.post(POOLS, json=pool(name, replicas))).status_code == 200
    for i in range(VALID):
        assert (await client.post(MODELS, json=model(i))).status_code == 200
    controller = asyncio.create_task(play_deployment_controller(api, client))
    try:
        await eventually(lambda: all(ready(api, f"m{i:03d}") for i in range(VALID)),
                         timeout=120, what=f"{VALID} valid models Ready")
    finally:
        controller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await controller
    seconds = time.monotonic() - started
    for name, message in (("huge", "replicas"), ("over-gpus", "--max-pool-gpus")):
        stored = api.get("kvpilot.dev/v1alpha1/decodepools", NAMESPACE, name)
        degraded = [c for c in stored.get("status", {}).get("conditions", [])
                    if c["type"] == "Degraded" and c["status"] == "True"]
        assert degraded and message in degraded[0]["message"], stored.get("status")
        assert not [s for s in api.live("apps/v1/statefulsets", NAMESPACE)
                    if s["metadata"]["name"].startswith(f"{name}-")]
    # The largest pool the operator accepts is rendered and applied, off the loop.
    await eventually(lambda: len([s for s in api.live("apps/v1/statefulsets", NAMESPACE)
                                  if s["metadata"]["name"].startswith("largest-g")]) == 256,
                     timeout=120, what="256 StatefulSets of the largest pool")
    growth = rss.stop()
    print(f"{VALID} models Ready in {seconds:.1f} s next to the hostile pools; "
          f"peak RSS growth {growth / 2**20:.0f} MiB")
    assert growth < RSS_GROWTH_LIMIT
