"""`kvpilot up` scaling 2 -> 1 while long greedy streams run on both replicas: the leaving
replica hands its streams over after `--drain-handover-timeout` (1 s here, through
spec.engine.extraArgs: the tiny model decodes so fast that a default 5 s could see a loaded
machine's streams end on their own before it), the router resumes them on the other, and the replica exits in seconds instead of after its
longest generation; every stream ends as an undisturbed run of it does (they all send one
prompt, greedy: those that moved and those that did not give the same text).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kvpilot.operator.local.supervisor import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
STREAMS = 12  # six on each replica: each runs well past the drain's start
MAX_TOKENS = 2000  # with a 2,048-token context: long enough to outlast the drain's start
DRAIN_LIMIT = 30.0  # the bound for a pod with a long generation in flight


async def generate(url: str, prompts: list[str], started: asyncio.Event | None = None
                   ) -> list[str]:
    """Gives the streamed text of each prompt (greedy); sets `started` once every stream has
    sent a token."""
    seen = 0

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        nonlocal seen
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True}
        pieces, first = [], True
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    pieces.append(event["choices"][0]["text"])
                    if first:
                        first, seen = False, seen + 1
                        if started is not None and seen == len(prompts):
                            started.set()
        assert line == "data: [DONE]" or pieces
        return "".join(pieces)

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return await asyncio.gather(*(one(client, p) for p in prompts))


@pytest.mark.slow
def test_a_leaving_replica_hands_its_streams_over_and_exits_in_seconds(tmp_path):
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["decode"]["replicas"] = 2
    manifest["spec"]["engine"].update(maxModelLen=2048, kvCacheMemory="256MiB",
                                      extraArgs=["--drain-handover-timeout", "1"])
    path, log, port = tmp_path / "fleet.yaml", tmp_path / "up.log", free_port()
    path.write_text(yaml.safe_dump(manifest))
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "kvpilot.cli.main", "up", str(path),
                               "--port", str(port), "--log-dir", str(tmp_path / "logs"),
                               "--timeout", "120"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        while f"{url}/v1" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        prompts = ["the drain's long story"] * STREAMS

        async def scale_down_while_streaming() -> tuple[list[str], float]:
            started = asyncio.Event()
            streams = asyncio.ensure_future(generate(url, prompts, started))
            await asyncio.wait_for(started.wait(), 120)
            manifest["spec"]["decode"]["replicas"] = 1
            path.write_text(yaml.safe_dump(manifest))
            sighup = time.monotonic()
            up.send_signal(signal.SIGHUP)
            while "2 -> 1 replica(s)" not in log.read_text():
                assert not streams.done() or streams.exception() is None, streams.exception()
                await asyncio.sleep(0.1)
            drained = time.monotonic() - sighup
            return await streams, drained

        texts, drained = asyncio.run(scale_down_while_streaming())
        line = re.search(r"reloaded .*: 2 -> 1 replica\(s\); (.*)", log.read_text())
        assert line and re.fullmatch(r"\S+-\d exited 0", line.group(1)), log.read_text()
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        moved = re.search(r'kvpilot_router_migrations_total\{outcome="resumed",'
                          r'reason="drained"\} (\S+)', metrics)
        print(f"\ndrain with {STREAMS} long streams: replica out in {drained:.1f}s, "
              f"{moved.group(1) if moved else 0} streams handed over")
        assert moved and float(moved.group(1)) >= 1, metrics
        assert drained <= DRAIN_LIMIT
        undisturbed = asyncio.run(generate(url, prompts[:1]))  # on the survivor, alone
        assert texts == undisturbed * STREAMS
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
