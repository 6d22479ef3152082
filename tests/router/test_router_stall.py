"""A frozen (SIGSTOPped) engine: the router finds it stalled within --stall-timeout, retries
the requests that had sent nothing elsewhere, and takes the engine back after SIGCONT.

Before: every request routed to a stopped engine waited --idle-timeout (60 s)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

import httpx
import pytest
from router_fake_engine import serving
from router_real_engines import start_engine, stop_all, wait_ready

from kvpilot.engine.contracts.router_args import SERVED_BY_HEADER, RouterArgs
from kvpilot.engine.router.app import build_app
from kvpilot.engine.router.stall import Stalled, find_stalled, until_stalled

STALL_TIMEOUT = 1.0
FAILOVER_LIMIT = 5.0  # the target, on this loaded 2-core box


@dataclass
class Member:
    name: str
    last_heard: float
    outstanding: bool = True
    waiting_since: float = 0.0
    ready: bool = True
    stalled: bool = False

    @property
    def silent_since(self) -> float:
        return max(self.last_heard, self.waiting_since)


@pytest.mark.parametrize(("members", "expected"), [
    # at now=10 with a 4 s timeout
    ([Member("a", 7), Member("b", 9)], []),  # a answered 3 s ago
    ([Member("a", 5, waiting_since=5.5), Member("b", 9)], ["a"]),
    ([Member("a", 1, waiting_since=7), Member("b", 9)], []),  # idle till 7: waited 3 s only
    ([Member("a", 1), Member("b", 9)], ["a"]),
    ([Member("a", 1, outstanding=False), Member("b", 9)], []),  # idle: nothing to miss
    ([Member("a", 1), Member("b", 2)], []),  # nobody answers: the router's fault, not a's
    ([Member("a", 1)], []),  # a lone instance is never ejected for silence
    ([Member("a", 1, stalled=True), Member("b", 9)], []),  # found already
    ([Member("a", 1, ready=False), Member("b", 9)], []),  # still starting
    ([Member("a", 1), Member("b", 1), Member("c", 9)], ["a", "b"]),
])
def test_the_stall_rule(members, expected):
    assert [m.name for m in find_stalled(members, now=10, stall_timeout=4)] == expected


async def test_until_stalled_cancels_the_work_and_raises():
    stall, cancelled = asyncio.Event(), asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(60)
        finally:
            cancelled.set()
        return "never"

    async def freeze() -> None:
        await asyncio.sleep(0.05)
        stall.set()

    asyncio.get_running_loop().create_task(freeze())
    with pytest.raises(Stalled):
        await until_stalled(stall, work())
    assert cancelled.is_set()
    assert await until_stalled(asyncio.Event(), asyncio.sleep(0, "done")) == "done"


@pytest.mark.slow
async def test_a_stopped_engine_fails_over_within_the_stall_timeout(tmp_path):
    engines = [start_engine(tmp_path / f"engine-{i}.log") for i in range(2)]
    try:
        await asyncio.to_thread(wait_ready, engines)
        (frozen, frozen_url), (_, live_url) = engines
        args = RouterArgs(instances=f"{frozen_url},{live_url}", policy="round-robin",
                          refresh_interval=0.25, stall_timeout=STALL_TIMEOUT)
        app = build_app(args)
        router = app.state.router
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as client:
            for _ in range(200):
                if len(router.fleet.available(("both",))) == 2:
                    break
                await asyncio.sleep(0.05)

            async def timed(body: dict, route: str) -> tuple[float, str, int]:
                start = time.monotonic()
                answer = await client.post(route, json=body)
                return time.monotonic() - start, answer.headers.get(SERVED_BY_HEADER, ""), \
                    answer.status_code

            completion = {"model": "tiny-llama", "prompt": "freeze", "max_tokens": 4}
            chat = {"model": "tiny-llama", "max_tokens": 4, "stream": True,
                    "messages": [{"role": "user", "content": "freeze"}]}
            os.kill(frozen.pid, signal.SIGSTOP)
            results = await asyncio.gather(
                *(timed(completion, "/v1/completions") for _ in range(3)),
                *(timed(chat, "/v1/chat/completions") for _ in range(3)))
            failover = max(seconds for seconds, _, _ in results)
            print(f"failover under SIGSTOP: {failover:.2f}s "
                  f"(--stall-timeout {STALL_TIMEOUT}s, {len(results)} requests)")
            assert [(status, served) for _, served, status in results] == \
                [(200, live_url)] * len(results)
            assert failover <= FAILOVER_LIMIT
            assert router.fleet.instances[frozen_url].stalled
            metrics = (await client.get("/metrics")).text
            assert f'kvpilot_router_ejections_total{{instance="{frozen_url}"}}' in metrics

            os.kill(frozen.pid, signal.SIGCONT)  # it answers its next health check: back
            for _ in range(200):
                if len(router.fleet.available(("both",))) == 2:
                    break
                await asyncio.sleep(0.05)
            served = {(await client.post("/v1/completions", json=completion))
                      .headers[SERVED_BY_HEADER] for _ in range(4)}
            assert served == {frozen_url, live_url}
    finally:
        for proc, _ in engines:
            os.kill(proc.pid, signal.SIGCONT)
        stop_all(engines)
