"""`kvpilot operator` as a process: reconciles against the emulator and exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import httpx
from operator_harness import IMS, NAMESPACE, eventually

from kvpilot.operator.local.supervisor import free_port


async def test_operator_command_reconciles_and_stops_cleanly(api, client):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpilot.cli.main", "operator", "-n", NAMESPACE, "--dev",
         "--log-level", "warning", "--liveness", str(port), "--engine-image", "engine:test"],
        env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient() as http:
            async def healthy() -> bool:
                try:
                    return (await http.get(f"http://127.0.0.1:{port}/healthz")).is_success
                except httpx.HTTPError:
                    return False

            await eventually(healthy, timeout=60, what="liveness endpoint")
        await asyncio.sleep(0.5)
        manifest = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
                    "metadata": {"name": "proc", "namespace": NAMESPACE},
                    "spec": {"model": {"name": "proc", "source": "dummy:tiny-llama"},
                             "accelerator": {"vendor": "cpu"}}}
        r = await client.post(f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/"
                              "inferencemodels", json=manifest)
        assert r.status_code == 200, r.text
        await eventually(lambda: (api.get(IMS, NAMESPACE, "proc") or {}).get("status", {})
                         .get("observedGeneration") == 1, timeout=120, what="status")
        deployment = await eventually(
            lambda: api.get("apps/v1/deployments", NAMESPACE, "proc-decode"))
        assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "engine:test"
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)
        assert code == 0, proc.stdout.read().decode()[-2000:] if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
