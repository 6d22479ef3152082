"""Migration between real tiny engines: a greedy and a seeded stream whose engine is
SIGKILLed, or SIGSTOPped, after its first event end exactly as undisturbed runs of them do
(the same text, one [DONE], usage counted once), moved to another engine by the router."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest
from router_fake_engine import serving
from router_real_engines import start_engine, stop_all, wait_ready

from kvpilot.engine.contracts.router_args import SERVED_BY_HEADER, RouterArgs
from kvpilot.engine.router.app import build_app

MAX_TOKENS = 120
REQUESTS = {
    "completion_greedy": ("/v1/completions", {"prompt": "a story about a lighthouse",
                                              "temperature": 0}),
    "chat_seeded": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}],
                                             "temperature": 1.0, "top_p": 0.9, "seed": 4}),
}


def text_of(events: list[dict]) -> str:
    return "".join((c.get("text") or (c.get("delta") or {}).get("content") or "")
                   for e in events for c in e.get("choices") or [])


async def streamed(client: httpx.AsyncClient, name: str, disturb=None) -> tuple[str, list[dict]]:
    """Gives (the raw SSE text, its data events) of request `name`; `disturb(url)` is called
    with the serving engine's URL once the first token event arrived."""
    path, request = REQUESTS[name]
    body = {"model": "tiny-llama", **request, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    lines: list[str] = []
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        served = response.headers[SERVED_BY_HEADER]
        async for line in response.aiter_lines():
            lines.append(line)
            if disturb is not None and line.startswith("data: {") and text_of(
                    [json.loads(line[6:])]):
                disturb(served)
                disturb = None
    text = "\n".join(lines)
    return text, [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


@pytest.mark.slow
async def test_killed_and_stopped_engines_streams_end_as_undisturbed(tmp_path):
    engines = [start_engine(tmp_path / f"engine-{i}.log") for i in range(3)]
    pids = {url: proc.pid for proc, url in engines}
    stopped: list[int] = []
    try:
        await asyncio.to_thread(wait_ready, engines)
        args = RouterArgs(instances=",".join(pids), policy="round-robin",
                          refresh_interval=0.25, stall_timeout=1.0)
        app = build_app(args)
        router = app.state.router
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as client:
            for _ in range(200):
                if len(router.fleet.available(("both",))) == 3:
                    break
                await asyncio.sleep(0.05)
            reference = {name: await streamed(client, name) for name in REQUESTS}

            def kill(served: str) -> None:
                os.kill(pids[served], signal.SIGKILL)

            def stop(served: str) -> None:
                os.kill(pids[served], signal.SIGSTOP)
                stopped.append(pids[served])

            for name, disturb in (("completion_greedy", kill), ("chat_seeded", stop)):
                raw, events = await streamed(client, name, disturb)
                _, ref_events = reference[name]
                assert text_of(events) == text_of(ref_events), name
                assert raw.count("data: [DONE]") == 1, raw[-400:]
                assert not any("error" in e for e in events), raw[-400:]
                assert len({e["id"] for e in events}) == 1
                assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
            metrics = (await client.get("/metrics")).text
            for reason in ("upstream_failed", "stalled"):
                assert (f'kvpilot_router_migrations_total{{outcome="resumed",reason="{reason}"}} '
                        '1.0') in metrics, metrics
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stop_all(engines)
