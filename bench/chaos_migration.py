"""Chaos with migration: steady streaming load through `kvpilot up`'s router while one replica
is SIGKILLed every few seconds (the supervisor restarts it) and another SIGSTOPped and
SIGCONTed; every stream must end without an error and with exactly the text an undisturbed
run of the same request gives (greedy or seeded), and each migration's added latency is
reported (the router's own measure, break to the continuation's first byte, and the client's:
the gap at the moved token less the stream's median gap).

    python3 bench/chaos_migration.py --out bench/results/chaos_migration-CPU-DATE

Writes summary.json and NOTES-ready numbers on stdout; keeps the router log.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
MOVED = re.compile(r"stream (\S+) moved to \S+ after (\d+) tokens in ([\d.]+)s \((\w+):")


@dataclass
class Stream:
    key: int
    id: str = ""
    text: str = ""
    times: list[float] = field(default_factory=list)  # one per token event
    error: str = ""


def request_body(key: int) -> dict:
    """Gives request `key` of the fixed set: greedy for even keys, seeded for odd ones."""
    body = {"model": "tiny-llama", "prompt": f"chaos request {key}: tell a long story",
            "max_tokens": 96 + 8 * (key % 8), "ignore_eos": True, "stream": True}
    if key % 2:
        body.update(temperature=1.0, top_p=0.95, seed=key)
    else:
        body["temperature"] = 0
    return body


async def run_stream(client: httpx.AsyncClient, key: int) -> Stream:
    out, pieces = Stream(key), []
    try:
        async with client.stream("POST", "/v1/completions", json=request_body(key)) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return out
            done = False
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = json.dumps(event["error"])[:300]
                    return out
                out.id = out.id or event["id"]
                if event["choices"]:
                    pieces.append(event["choices"][0]["text"])
                    out.times.append(time.monotonic())
            if not done:
                out.error = "the stream ended without data: [DONE]"
    except httpx.HTTPError as exc:
        out.error = repr(exc)
    out.text = "".join(pieces)
    return out


def engine_pid(up: subprocess.Popen, url: str) -> int | None:
    """Gives the pid of the engine serving `url` now, None while it is being restarted."""
    port = url.rsplit(":", 1)[1]
    for child in psutil.Process(up.pid).children():
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if "serve" in argv and "--port" in argv and argv[argv.index("--port") + 1] == port:
            return child.pid
    return None


async def chaos(up: subprocess.Popen, urls: list[str], seconds: float, kill_every: float,
                events: list[str], rng: random.Random) -> None:
    """SIGSTOPs a replica for 6-9 s, SIGCONTs it, 4-6 s later another, ...; and SIGKILLs a
    replica (not the stopped one) every `kill_every` seconds."""
    started = time.monotonic()
    stopped: tuple[int, float] | None = None
    next_kill = started + kill_every / 2
    next_stop = started + 3
    while time.monotonic() - started < seconds:
        now = time.monotonic()
        if stopped and now >= stopped[1]:
            os.kill(stopped[0], signal.SIGCONT)
            events.append(f"{now - started:.1f}s SIGCONT")
            stopped, next_stop = None, now + rng.uniform(4, 6)
        elif stopped is None and now >= next_stop:
            victim = rng.choice(urls)
            pid = engine_pid(up, victim)
            if pid is not None:
                os.kill(pid, signal.SIGSTOP)
                stopped = (pid, now + rng.uniform(6, 9))
                events.append(f"{now - started:.1f}s SIGSTOP {victim}")
        if now >= next_kill:
            pids = [p for u in urls if (p := engine_pid(up, u)) is not None
                    and (not stopped or p != stopped[0])]
            if pids:
                pid = rng.choice(pids)
                os.kill(pid, signal.SIGKILL)
                events.append(f"{now - started:.1f}s SIGKILL pid {pid}")
            next_kill = now + kill_every
        await asyncio.sleep(0.1)
    if stopped:
        os.kill(stopped[0], signal.SIGCONT)


async def load(url: str, seconds: float, workers: int, keys: int) -> list[Stream]:
    results: list[Stream] = []
    deadline = time.monotonic() + seconds

    async def worker(index: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            key = index
            while time.monotonic() < deadline:
                results.append(await run_stream(client, key % keys))
                key += workers

    await asyncio.gather(*(worker(i) for i in range(workers)))
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=8.0)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--keys", type=int, default=24)
    parser.add_argument("--seed", type=int, default=48)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text()))
    manifest["spec"]["decode"]["replicas"] = args.replicas
    (args.out / "fleet.yaml").write_text(yaml.safe_dump(manifest))
    logs = args.out / "logs"
    port = 18000 + os.getpid() % 1000
    up = subprocess.Popen([sys.executable, "-m", "kvpilot.cli.main", "up",
                           str(args.out / "fleet.yaml"), "--port", str(port), "--log-dir",
                           str(logs)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert up.stdout is not None
        print(up.stdout.readline().strip())
        urls = [item.split("=", 1)[1] for item in
                (logs / "router-instances").read_text().strip().split(",")]

        async def run() -> tuple[dict[int, str], list[Stream], list[str]]:
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                reference = {k: (await run_stream(client, k)).text for k in range(args.keys)}
            events: list[str] = []
            streams, _ = await asyncio.gather(
                load(url, args.seconds, args.workers, args.keys),
                chaos(up, urls, args.seconds, args.kill_every, events,
                      random.Random(args.seed)))
            return reference, streams, events

        reference, streams, events = asyncio.run(run())
    finally:
        for child in psutil.Process(up.pid).children():
            child.send_signal(signal.SIGCONT)
        up.send_signal(signal.SIGTERM)
        up.wait(120)
    moved: dict[str, list[tuple[int, float, str]]] = {}
    for line in (logs / "tiny-router.log").read_text(errors="replace").splitlines():
        if (found := MOVED.search(line)):
            sid, tokens, took, reason = found.groups()
            moved.setdefault(sid, []).append((int(tokens), float(took), reason))
    errors = [s for s in streams if s.error]
    different = [s for s in streams if not s.error and s.text != reference[s.key]]
    router_cost: dict[str, list[float]] = {}
    client_added: dict[str, list[float]] = {}
    for s in streams:
        gaps = [b - a for a, b in zip(s.times, s.times[1:], strict=False)]
        median = statistics.median(gaps) if gaps else 0.0
        for tokens, took, reason in moved.get(s.id, []):
            router_cost.setdefault(reason, []).append(took)
            if 0 < tokens < len(s.times):
                client_added.setdefault(reason, []).append(s.times[tokens] - s.times[tokens - 1]
                                                           - median)
    summary = {
        "replicas": args.replicas, "seconds": args.seconds, "kill_every": args.kill_every,
        "workers": args.workers, "streams": len(streams), "client_errors": len(errors),
        "different_from_undisturbed": len(different),
        "migrations": sum(len(v) for v in moved.values()), "events": events,
        "router_break_to_first_byte_s": {r: {"n": len(v), "p50": percentile(v, 0.5),
                                             "p99": percentile(v, 0.99)}
                                         for r, v in router_cost.items()},
        "client_added_gap_s": {r: {"n": len(v), "p50": percentile(v, 0.5),
                                   "p99": percentile(v, 0.99)}
                               for r, v in client_added.items()},
        "error_samples": [s.error for s in errors[:5]],
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
