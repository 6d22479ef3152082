"""A soak run: a fleet under steady mixed traffic, and whether its resources return to baseline.

One `kvpilot serve` engine (LoRA on, one adapter at start-up, a fleet secret) behind one
`kvpilot route` router (prefix-aware, with the model's tokenizer, so it keeps a prefix
index fed by the engine's KV events). Each cycle sends `--cycle-seconds` of traffic from
`--concurrency` clients through the router: completions and chats, streamed and not, on
the base model and the adapter, with shared prefixes; streams the client drops after two
chunks (disconnects); requests it gives up on before the first byte (aborts); and, on the
engine, an adapter loaded, used and unloaded again. Then the traffic pauses, the engine
drains, the router polls its events, and this is sampled: the engine's RSS (core process
and API server), its KV blocks in use, open fds and threads of the core, the API server and
the router, the router's prefix-index entries and the requests it counts in flight.

The first idle sample after a warm-up cycle is the baseline; the report gives each
resource's drift (last - baseline) and its slope, and exit code 1 names what did not come
back: KV blocks in use, router requests in flight or a failed probe request above 0 at an
idle sample, fds or
threads above baseline + 8 (bounded pools' headroom), RSS above baseline + max(24 MiB,
5%), index entries above the engine's block count. Before each sample one request goes
through the router, so its connection pool drops the keep-alive connections the engine
closed meanwhile: what stays open is a leak.

    python bench/soak.py --minutes 10 --out bench/results/soak-CPU-2026-12-04
    python bench/soak.py --cycles 2 --cycle-seconds 3 --out /tmp/soak   (the suite's)

Hours where a user runs it: `--minutes 240`. `--engine-env K=V` sets the engine's
environment only (the suite injects a leak that way).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from kvpilot.engine.contracts import metric_names as names
from kvpilot.engine.contracts.builtin_models import BUILTIN_CONFIGS
from kvpilot.engine.contracts.fleet_secret import FleetSecret
from kvpilot.operator.local.supervisor import free_port

KVPILOT = [sys.executable, "-m", "kvpilot.cli.main"]
MODEL = "tiny-llama"
ADAPTER = "sql"
KINDS = ("complete", "stream", "chat", "disconnect", "abort", "adapter")
WORDS = ["the", "a", "of", "KV", "cache", "block", "token", "prefix", "router", "engine", "soak", "leak", "drift", "pool", "batch"]
# headroom of bounded pools: executor threads (up to CPUs + 4), keep-alive connections
FD_THREAD_SLACK = 8
RSS_SLACK_BYTES, RSS_SLACK_SHARE = 24 * 2**20, 0.05


def write_adapter(path: Path, seed: int, rank: int = 4) -> Path:
    """Gives a PEFT LoRA adapter dir for tiny-llama's q/v projections (random weights)."""
    import torch
    from safetensors.torch import save_file

    config = BUILTIN_CONFIGS[MODEL]
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    outs = {"q_proj": config["num_attention_heads"] * head_dim,
            "v_proj": config["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.1
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(outs), "bias": "none"}))
    return path


@dataclass
class Fleet:
    """The engine and router processes, their URLs and logs."""

    workdir: Path
    num_kv_blocks: int
    engine_env: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    engine_url: str = ""
    router_url: str = ""

    def start(self) -> None:
        secret = self.workdir / "fleet-secret"
        secret.write_text(FleetSecret.generate().secret.hex())
        adapter = write_adapter(self.workdir / "adapters" / ADAPTER, seed=1)
        write_adapter(self.workdir / "adapters" / "churn", seed=2)
        engine_port, router_port = free_port(), free_port()
        self.engine_url = f"http://127.0.0.1:{engine_port}"
        self.router_url = f"http://127.0.0.1:{router_port}"
        self._spawn("engine", [*KVPILOT, "serve", MODEL, "--device", "cpu", "--port",
                               str(engine_port), "--num-kv-blocks", str(self.num_kv_blocks),
                               "--max-model-len", "1024", "--enable-lora", "--max-loras", "2",
                               "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={adapter}",
                               "--fleet-secret-file", str(secret), "--log-level", "warning"],
                    self.engine_env)
        self._wait(self.engine_url + "/ready")
        self._spawn("router", [*KVPILOT, "route", "--instances", f"both={self.engine_url}",
                               "--port", str(router_port), "--tokenizer", MODEL,
                               "--refresh-interval", "0.25", "--fleet-secret-file", str(secret),
                               "--log-level", "warning"], {})
        self._wait(self.router_url + "/ready")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = (self.workdir / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **env})

    def _wait(self, url: str, seconds: float = 180.0) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited: {self.log(name)[-3000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{url} not ready within {seconds:.0f} s")

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def processes(self) -> dict[str, psutil.Process]:
        """Gives the measured processes: the engine's API server (its launcher), its core
        (the spawned child) and the router."""
        api = psutil.Process(self.procs["engine"].pid)
        core = next(p for p in api.children() if "spawn_main" in " ".join(p.cmdline()))
        return {"engine_api": api, "engine_core": core,
                "router": psutil.Process(self.procs["router"].pid)}

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def metric(text: str, name: str, label: str | None = None) -> float:
    """Gives the sum of a metric's samples (or a label's value of its first sample)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            if label is not None:
                return float(line.split(f'{label}="', 1)[1].split('"', 1)[0])
            total += float(line.rsplit(" ", 1)[1])
    return total


def prompt(rng: random.Random) -> str:
    """Gives a prompt: one of 8 shared prefixes (prefix hits) and a random tail."""
    head = random.Random(rng.randrange(8)).choices(WORDS, k=40)
    return " ".join([*head, *rng.choices(WORDS, k=rng.randrange(2, 30))])


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random,
                      outcomes: Counter[str]) -> None:
    """Sends one request of `kind` through the router and counts how it ended."""
    model = ADAPTER if kind == "adapter" else MODEL
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randrange(4, 32),
                            "ignore_eos": True}
    if kind == "chat":
        url, body["messages"] = "/v1/chat/completions", [{"role": "user",
                                                          "content": prompt(rng)}]
    else:
        url, body["prompt"] = "/v1/completions", prompt(rng)
    body["stream"] = kind in ("stream", "disconnect")
    try:
        if kind == "abort":  # the client gives up before the first byte
            await client.post(url, json=body, timeout=httpx.Timeout(0.02))
            outcomes["abort-answered"] += 1
        elif body["stream"]:
            async with client.stream("POST", url, json=body) as answer:
                chunks = 0
                async for _ in answer.aiter_lines():
                    chunks += 1
                    if kind == "disconnect" and chunks >= 2:
                        break  # leaving the block closes the connection mid-stream
                outcomes[f"{kind}-{answer.status_code}"] += 1
        else:
            answer = await client.post(url, json=body)
            outcomes[f"{kind}-{answer.status_code}"] += 1
    except httpx.TimeoutException:
        outcomes[f"{kind}-timeout"] += 1


async def churn_adapter(engine: httpx.AsyncClient, router: httpx.AsyncClient, path: Path,
                        cycle: int, outcomes: Counter[str]) -> None:
    """Loads an adapter on the engine, sends it requests, unloads it (retrying while in use)."""
    name = f"churn-{cycle}"
    loaded = await engine.post("/v1/load_lora_adapter",
                               json={"lora_name": name, "lora_path": str(path)})
    outcomes[f"load-{loaded.status_code}"] += 1
    for _ in range(3):
        try:  # one that hangs (a leak left the KV cache no room) is counted, not fatal
            answer = await router.post("/v1/completions", json={
                "model": name, "prompt": "churn " * 8, "max_tokens": 4})
            outcomes[f"churn-{answer.status_code}"] += 1
        except httpx.TimeoutException:
            outcomes["churn-timeout"] += 1
    for _ in range(100):
        status = (await engine.post("/v1/unload_lora_adapter",
                                    json={"lora_name": name})).status_code
        if status != 400:
            break
        await asyncio.sleep(0.1)  # a request still uses it
    else:
        status = "still-in-use"
    outcomes[f"unload-{status}"] += 1


async def traffic(fleet: Fleet, seconds: float, concurrency: int, cycle: int,
                  outcomes: Counter[str]) -> None:
    """Runs one cycle of mixed traffic."""
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=fleet.router_url, timeout=60, limits=limits) as router, \
            httpx.AsyncClient(base_url=fleet.engine_url, timeout=60) as engine:

        async def worker(index: int) -> None:
            rng = random.Random(cycle * 1000 + index)
            while time.monotonic() < deadline:
                await one_request(router, rng.choice(KINDS), rng, outcomes)

        await asyncio.gather(*(worker(i) for i in range(concurrency)),
                             churn_adapter(engine, router, fleet.workdir / "adapters" / "churn",
                                           cycle, outcomes))


def idle_sample(fleet: Fleet, started: float) -> dict[str, float]:
    """Waits for the engine to drain and the router to take its events; gives the sample."""
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(fleet.engine_url + "/metrics", timeout=10).text
        busy = metric(text, names.NUM_REQUESTS_RUNNING) + metric(text, names.NUM_REQUESTS_WAITING)
        if busy == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # one request through the router: its pool prunes the connections the engine closed; one
    # that does not come back (a leak that left the KV cache no room) is a failed sample,
    # not the end of the run
    try:
        httpx.post(fleet.router_url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "probe", "max_tokens": 1}).raise_for_status()
        probe_failed = 0
    except httpx.HTTPError:
        probe_failed = 1
    time.sleep(1.5)  # the router polls /kv_events every 0.25 s
    text = httpx.get(fleet.engine_url + "/metrics", timeout=10).text
    blocks = metric(text, names.CACHE_CONFIG_INFO, names.NUM_GPU_BLOCKS_LABEL)
    router_text = httpx.get(fleet.router_url + "/metrics", timeout=10).text
    sample = {"seconds": round(time.monotonic() - started, 1),
              "kv_blocks_in_use": round(metric(text, names.KV_CACHE_USAGE_PERC) * blocks),
              "index_entries": metric(router_text, names.ROUTER_PREFIX_INDEX_ENTRIES),
              "router_in_flight": metric(router_text, names.ROUTER_IN_FLIGHT),
              "probe_failed": probe_failed}
    for name, proc in fleet.processes().items():
        sample[f"rss_mib_{name}"] = round(proc.memory_info().rss / 2**20, 1)
        sample[f"fds_{name}"] = proc.num_fds()
        sample[f"threads_{name}"] = proc.num_threads()
    return sample


def verdicts(samples: list[dict[str, float]], num_blocks: int) -> dict[str, dict[str, Any]]:
    """Gives, per resource, its baseline (the first sample), last value, drift, slope per
    hour and whether it came back (see the module doc for the rules)."""
    base, last = samples[0], samples[-1]
    hours = max(last["seconds"] - base["seconds"], 1e-9) / 3600
    out = {}
    for key in base:
        if key == "seconds":
            continue
        drift = last[key] - base[key]
        if key in ("kv_blocks_in_use", "router_in_flight", "probe_failed"):
            ok, rule = all(s[key] == 0 for s in samples), "0 at every idle sample"
        elif key == "index_entries":
            ok, rule = all(s[key] <= num_blocks for s in samples), f"<= {num_blocks} blocks"
        elif key.startswith("rss"):
            slack = max(RSS_SLACK_BYTES / 2**20, RSS_SLACK_SHARE * base[key])
            ok, rule = drift <= slack, f"drift <= {slack:.1f} MiB"
        else:
            ok, rule = drift <= FD_THREAD_SLACK, f"drift <= {FD_THREAD_SLACK}"
        out[key] = {"baseline": base[key], "last": last[key], "drift": round(drift, 1),
                    "slope_per_hour": round(drift / hours, 1) if len(samples) > 1 else 0.0,
                    "rule": rule, "ok": ok}
    return out


def write_report(out: Path, run: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(run, indent=1) + "\n")
    rows = ["| resource | baseline | last | drift | slope / h | rule | back to baseline |",
            "|---|---|---|---|---|---|---|"]
    for key, v in run["verdicts"].items():
        rows.append(f"| {key} | {v['baseline']} | {v['last']} | {v['drift']} | "
                    f"{v['slope_per_hour']} | {v['rule']} | {'yes' if v['ok'] else '**no**'} |")
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(run["outcomes"].items()))
    (out / "soak.md").write_text(
        f"# Soak: {run['minutes_of_traffic']:.1f} min of mixed traffic, {run['cycles']} cycles\n\n"
        f"{run['machine']}, {run['date']}; `{run['command']}`\n\n" + "\n".join(rows)
        + f"\n\nRequests by kind and status: {outcomes}.\n\nIdle samples: "
        f"{len(run['samples'])} (the first, after a warm-up cycle, is the baseline); "
        "all in `soak.json`.\n")


def main() -> int:
    parser = argparse.ArgumentParser(description="a fleet under steady mixed traffic, and "
                                     "whether its resources return to baseline")
    parser.add_argument("--minutes", type=float, default=None,
                        help="minutes of traffic (sets --cycles from --cycle-seconds)")
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--cycle-seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--num-kv-blocks", type=int, default=96)
    parser.add_argument("--engine-env", action="append", default=[], metavar="K=V")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cycles = (max(2, round(args.minutes * 60 / args.cycle_seconds)) if args.minutes
              else args.cycles)
    with tempfile.TemporaryDirectory(prefix="kvpilot-soak-") as tmp:
        fleet = Fleet(Path(tmp), args.num_kv_blocks,
                      dict(item.split("=", 1) for item in args.engine_env))
        outcomes: dict[str, int] = {}
        samples: list[dict[str, float]] = []
        try:
            fleet.start()
            started = time.monotonic()
            for cycle in range(cycles + 1):  # cycle 0 warms up
                counts: Counter[str] = Counter()
                asyncio.run(traffic(fleet, args.cycle_seconds, args.concurrency, cycle, counts))
                for key, value in counts.items():
                    outcomes[key] = outcomes.get(key, 0) + value
                samples.append(idle_sample(fleet, started))
                print(json.dumps({"cycle": cycle, **samples[-1]}), flush=True)
        finally:
            fleet.stop()
    run = {"date": datetime.date.today().isoformat(),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
           "command": " ".join(["python", "bench/soak.py", *sys.argv[1:]]),
           "cycles": cycles, "minutes_of_traffic": cycles * args.cycle_seconds / 60,
           "concurrency": args.concurrency, "num_kv_blocks": args.num_kv_blocks,
           "outcomes": outcomes, "samples": samples,
           "verdicts": verdicts(samples, args.num_kv_blocks)}
    write_report(args.out, run)
    # server errors, and requests that hung past the client's 60 s (an abort's timeout is meant)
    errors = {k: v for k, v in outcomes.items() if k.rsplit("-", 1)[1].startswith("5")
              or (k.endswith("-timeout") and not k.startswith("abort"))}
    leaked = [k for k, v in run["verdicts"].items() if not v["ok"]]
    print(json.dumps({"leaked": leaked, "server_errors": errors}), flush=True)
    return 1 if leaked or errors else 0


if __name__ == "__main__":
    sys.exit(main())
