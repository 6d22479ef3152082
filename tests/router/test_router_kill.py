"""An engine process SIGKILLed mid-stream: a stream pinned to it gets an error event fast
(pinned, it does not move: `test_router_migration.py`), the router ejects the instance, and
later requests succeed on the other one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from helpers import sse
from router_fake_engine import FakeEngine, serving

from kvpilot.engine.contracts.router_args import INSTANCE_HEADER, SERVED_BY_HEADER, RouterArgs
from kvpilot.engine.router.app import build_app
from kvpilot.operator.local.supervisor import free_port

HERE = Path(__file__).parent


async def wait_up(url: str, deadline: float) -> None:
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(url + "/v1/models")).status_code == 200:
                    return
            except httpx.HTTPError:
                await asyncio.sleep(0.05)
    raise TimeoutError(f"{url} did not come up")


async def test_killed_engine_mid_stream():
    port = free_port()
    victim_url = f"http://127.0.0.1:{port}"
    victim = subprocess.Popen([sys.executable, str(HERE / "router_fake_engine.py"), str(port),
                               "victim", "0.02"], cwd=HERE)
    try:
        await wait_up(victim_url, time.monotonic() + 20)
        async with serving(FakeEngine("survivor").app()) as survivor_url:
            args = RouterArgs(instances=f"{victim_url},{survivor_url}", policy="round-robin",
                              eject_after_failures=1, eject_seconds=60, refresh_interval=60)
            async with serving(build_app(args)) as router, \
                    httpx.AsyncClient(base_url=router, timeout=10) as client:
                body = {"model": "tiny", "prompt": "hi", "max_tokens": 9999, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body,
                                         headers={INSTANCE_HEADER: victim_url}) as stream:
                    lines = sse.aiter_lines(stream)
                    first = await anext(lines)
                    assert json.loads(first.removeprefix("data: "))["choices"]
                    os.kill(victim.pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                    last = first
                    async for line in lines:
                        if line:
                            last = line
                    waited = time.monotonic() - killed_at
                error = json.loads(last.removeprefix("data: "))["error"]
                assert f"not resumed: pinned to {victim_url}" in error["message"], error
                assert waited < 5, waited
                served = []
                for _ in range(4):
                    response = await client.post("/v1/completions", json={**body,
                                                                           "stream": False})
                    assert response.status_code == 200
                    served.append(response.headers[SERVED_BY_HEADER])
                assert served == [survivor_url] * 4
                metrics = (await client.get("/metrics")).text
                assert f'kvpilot_router_ejections_total{{instance="{victim_url}"}} 1.0' in metrics
    finally:
        victim.kill()
        victim.wait(10)
