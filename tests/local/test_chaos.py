"""Chaos: load through `kvpilot up`'s router while its replicas are SIGKILLed, SIGSTOPped and
SIGCONTed at random (seeded); the supervisor restarts the killed ones.

A request may fail only if a replica was killed while it streamed from that replica (the
router's `x-kvpilot-served-by` names it); every other request must succeed: retried before
its first byte (a refused connection, a stalled replica) or resumed (a stopped replica
that continues). The numbers are printed (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from helpers import sse

from kvpilot.engine.contracts.router_args import SERVED_BY_HEADER
from kvpilot.operator.local.supervisor import free_port

ROOT = Path(__file__).parents[2]
SEED = 18
REPLICAS = 3
LOAD_SECONDS = 21.0
EVENTS_AT = (3.0, 9.0, 15.0)  # seconds into the load; each disturbs another replica
WORKERS = 3
# the load goes on past LOAD_SECONDS until this many requests were sent (a loaded machine
# serves fewer per second), but never past LOAD_LIMIT_SECONDS
MIN_REQUESTS = 36
LOAD_LIMIT_SECONDS = 300.0


@dataclass
class Outcome:
    start: float
    end: float
    ok: bool
    served_by: str
    detail: str


@dataclass
class Event:
    at: float
    action: str  # kill | stop
    url: str
    until: float  # SIGCONT time of a stop


def replica_pid(up: subprocess.Popen[str], url: str) -> int:
    """Gives the pid of the engine process serving `url` now (it changes on a restart)."""
    port = url.rsplit(":", 1)[1]
    for child in psutil.Process(up.pid).children():
        argv = child.cmdline()
        if "serve" in argv and "--port" in argv and argv[argv.index("--port") + 1] == port:
            return child.pid
    raise LookupError(f"no engine process serves {url}")


def stream_error(text: str) -> bool:
    """Whether an SSE body carries an error event (generated text may say "error" too)."""
    return any("error" in json.loads(line[6:]) for line in sse.lines(text)
               if line.startswith("data: {"))


async def one_request(client: httpx.AsyncClient, rng: random.Random) -> Outcome:
    stream = rng.random() < 0.5
    body = {"model": "tiny-llama", "max_tokens": rng.randint(4, 16), "ignore_eos": True,
            "stream": stream, "prompt": f"chaos {rng.random()}"}
    start = time.monotonic()
    served, detail = "", ""
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            served = response.headers.get(SERVED_BY_HEADER, "").split(",")[-1]
            text = "".join([chunk async for chunk in response.aiter_text()])
        if response.status_code != 200:
            detail = f"HTTP {response.status_code}: {text[:200]}"
        elif stream and (stream_error(text) or not text.rstrip().endswith("data: [DONE]")):
            detail = f"stream ended badly: {text[-300:]}"
        elif not stream and not json.loads(text)["choices"]:
            detail = f"no choices: {text[:200]}"
    except httpx.HTTPError as exc:
        detail = repr(exc)
    return Outcome(start, time.monotonic(), not detail, served, detail)


async def load(base: str, until: float, outcomes: list[Outcome]) -> None:
    limit = until - LOAD_SECONDS + LOAD_LIMIT_SECONDS

    def more() -> bool:
        now = time.monotonic()
        return now < until or (len(outcomes) < MIN_REQUESTS and now < limit)

    async def worker(index: int) -> None:
        rng = random.Random(SEED * 100 + index)
        async with httpx.AsyncClient(base_url=base, timeout=90) as client:
            while more():
                outcomes.append(await one_request(client, rng))

    await asyncio.gather(*(worker(i) for i in range(WORKERS)))


async def chaos(up: subprocess.Popen[str], urls: list[str], started: float,
                events: list[Event]) -> None:
    rng = random.Random(SEED)
    actions = ["kill", "stop", rng.choice(["kill", "stop"])]  # each kind at least once
    rng.shuffle(actions)
    previous = ""
    for offset, action in zip(EVENTS_AT, actions, strict=True):
        await asyncio.sleep(max(0.0, started + offset - time.monotonic()))
        url = rng.choice([u for u in urls if u != previous])
        previous = url
        pid = replica_pid(up, url)
        if action == "kill":
            os.kill(pid, signal.SIGKILL)
            events.append(Event(time.monotonic(), "kill", url, 0.0))
        else:
            pause = rng.uniform(2.0, 5.0)
            os.kill(pid, signal.SIGSTOP)
            events.append(Event(time.monotonic(), "stop", url, time.monotonic() + pause))
            await asyncio.sleep(pause)
            os.kill(pid, signal.SIGCONT)


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def excused(outcome: Outcome, events: list[Event]) -> bool:
    """Whether the request was in flight on a replica killed meanwhile."""
    return any(e.action == "kill" and e.url == outcome.served_by
               and outcome.start <= e.at <= outcome.end for e in events)


@pytest.mark.slow
def test_no_request_is_lost_outside_a_killed_replica(tmp_path):
    manifest = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text()))
    manifest["spec"]["decode"]["replicas"] = REPLICAS
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(manifest))
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "kvpilot.cli.main", "up",
                           str(tmp_path / "fleet.yaml"), "--port", str(port), "--log-dir",
                           str(tmp_path / "logs")], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert up.stdout is not None
        line = up.stdout.readline()  # printed once the fleet is ready
        assert f"http://127.0.0.1:{port}/v1" in line, line
        urls = [item.split("=", 1)[1] for item in
                (tmp_path / "logs" / "router-instances").read_text().strip().split(",")]
        assert len(urls) == REPLICAS
        outcomes: list[Outcome] = []
        events: list[Event] = []

        async def run() -> None:
            started = time.monotonic()
            await asyncio.gather(load(f"http://127.0.0.1:{port}", started + LOAD_SECONDS,
                                      outcomes),
                                 chaos(up, urls, started, events))

        asyncio.run(run())
        lost = [o for o in outcomes if not o.ok and not excused(o, events)]
        failed_on_killed = [o for o in outcomes if not o.ok and excused(o, events)]
        slowest = max(o.end - o.start for o in outcomes)
        ok = len(outcomes) - len(failed_on_killed) - len(lost)
        print(f"\nchaos: {len(outcomes)} requests, {ok} ok, {len(failed_on_killed)} failed in "
              f"flight on a killed replica, {len(lost)} lost; slowest {slowest:.1f}s; events: "
              + ", ".join(f"{e.action} {e.url.rsplit(':', 1)[1]}" for e in events))
        assert len(events) == len(EVENTS_AT) and len(outcomes) >= MIN_REQUESTS
        assert lost == [], lost
        for url in urls:  # the killed replicas were restarted and serve again
            replica_pid(up, url)
            deadline = time.monotonic() + 60
            while not ready(url):
                assert time.monotonic() < deadline, f"{url} did not come back"
                time.sleep(0.2)
    finally:
        for child in psutil.Process(up.pid).children():
            child.send_signal(signal.SIGCONT)
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
