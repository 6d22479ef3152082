"""Router flow control and predicted-latency placement on CPU engines under `kvpilot up`.

Three scenarios, each on a fresh tiny-llama fleet (`kvpilot up` of a generated manifest),
each phase a bounded open-loop run of streamed completions with Poisson arrivals:

- noisy: one replica, flow control on. Capacity C is measured first (closed loop); then
  tenant B alone at 0.2 C; then tenant A at 3 C with B at 0.2 C (`x-gateway-inference-
  fairness-id`). Reports B's TTFT p99 both times, A's 429s and their Retry-After, and
  requests lost (no answer) or hung (past the client's time-out).
- priorities: the same fleet shape; objective `high` (priority 10) at 0.2 C alone, then
  with objective `low` (priority 0) at 3 C (`x-gateway-inference-objective`).
- placement: two replicas, a mixed workload of short chats and long documents at a fixed
  rate, once with `prefix-aware` and once with `predicted-latency`. By default every prompt
  is unique (the prefix-hit rate is the same, about zero, for both policies); with
  `--shared-documents K` a document request asks a question (its own `--question-words`)
  about one of K shared documents drawn with Zipf popularity (`--popularity-exponent`), so
  the workload offers both policies the same prefixes to hit. Reports TTFT p50/p99, SLO
  attainment (TTFT <= --slo-ms), throughput, each router's prefix-hit rate and the
  predictor's error (|predicted - observed| / observed, from the router's
  x-kvpilot-predicted-ttft-ms).

    nice -n 10 .venv/bin/python bench/flow_control.py --scenarios noisy,priorities,placement
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

RESULTS = Path(__file__).parent / "results"
KVPILOT = [sys.executable, "-m", "kvpilot.cli.main"]
MODEL = "tiny-llama"


def manifest(replicas: int, router: dict, step_tokens: int = 512) -> dict:
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": "bench"},
            "spec": {"model": {"name": MODEL, "source": "dummy:tiny-llama"},
                     "engine": {"dtype": "float32", "maxModelLen": 4096, "maxNumSeqs": 8,
                                "maxNumBatchedTokens": step_tokens, "kvCacheMemory": "128MiB"},
                     "accelerator": {"vendor": "cpu"}, "servingMode": "aggregated",
                     "decode": {"replicas": replicas}, "router": {"replicas": 1, **router}}}


class Fleet:
    """`kvpilot up` of a manifest, on a free port, until closed."""

    def __init__(self, spec: dict, port: int, log_dir: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvpilot-flow-"))
        path = self.dir / "fleet.yaml"
        path.write_text(yaml.safe_dump(spec))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_dir / "up.log", "w")  # noqa: SIM115 (closed by close())
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([*KVPILOT, "up", str(path), "--port", str(port),
                                      "--log-dir", str(log_dir)], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 300) -> None:
        Fleet.wait_url(self.url, self.proc, timeout)

    @staticmethod
    def wait_url(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited {proc.returncode}")
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{url} not ready")

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@dataclass
class Result:
    group: str
    status: int = 0  # 0: no answer (lost), -1: client time-out (hung)
    ttft: float | None = None
    e2e: float = 0.0
    retry_after: str | None = None
    predicted_ms: float | None = None
    events: int = 0


@dataclass
class Stream:
    """One Poisson request stream: its group name, rate, headers and prompt shape."""

    group: str
    rate: float
    headers: dict[str, str] = field(default_factory=dict)
    words: tuple[int, ...] = (12, 20)
    max_tokens: int = 16
    # the flood's client stands in for machines of its own: on a small host it runs at the
    # lowest CPU priority, so its own work does not take the fleet's cores (--flood-nice)
    nice: int = 0
    # shared documents: a request's prompt is one of these (drawn by `popularity`) followed by
    # its own `words`; none: the prompt is its own words only
    documents: tuple[str, ...] = ()
    popularity: tuple[float, ...] = ()


def prompt(rng: random.Random, words: int, salt: str = "") -> str:
    return " ".join(f"w{rng.randrange(100000)}x{salt}" for _ in range(words))


async def one(client: httpx.AsyncClient, url: str, stream: Stream, rng: random.Random,
              timeout: float, salt: str = "") -> Result:
    text = prompt(rng, rng.randint(*stream.words), salt)
    if stream.documents:
        text = rng.choices(stream.documents, stream.popularity)[0] + " " + text
    body = {"model": MODEL, "prompt": text,
            "max_tokens": stream.max_tokens, "ignore_eos": True, "stream": True}
    result = Result(stream.group)
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + "/v1/completions", json=body,
                                     headers=stream.headers) as response:
                result.status = response.status_code
                result.retry_after = response.headers.get("retry-after")
                predicted = response.headers.get("x-kvpilot-predicted-ttft-ms")
                result.predicted_ms = float(predicted) if predicted else None
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if result.ttft is None:
                            result.ttft = time.perf_counter() - start
                        result.events += 1
    except TimeoutError:
        result.status = -1
    except httpx.HTTPError:
        result.status = 0
    result.e2e = time.perf_counter() - start
    return result


async def open_loop(url: str, streams: list[Stream], seconds: float, seed: int,
                    timeout: float, salt: str = "") -> tuple[list[Result], float]:
    """Sends each stream's Poisson arrivals for `seconds`; gives every result and the wall
    time until the last one ended."""
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        tasks: list[asyncio.Task[Result]] = []
        start = time.perf_counter()

        async def arrivals(stream: Stream, rng: random.Random) -> None:
            t = 0.0
            while True:
                t += rng.expovariate(stream.rate)
                if t >= seconds:
                    return
                await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
                tasks.append(asyncio.create_task(one(client, url, stream, rng, timeout, salt)))

        await asyncio.gather(*(arrivals(s, random.Random(seed + n))
                               for n, s in enumerate(streams)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _stream_in_process(url: str, stream: Stream, seconds: float, seed: int,
                       timeout: float) -> tuple[list[Result], float]:
    if stream.nice:
        os.nice(stream.nice)
    return asyncio.run(open_loop(url, [stream], seconds, seed, timeout))


def open_loops(url: str, streams: list[Stream], seconds: float, seed: int,
               timeout: float) -> tuple[list[Result], float]:
    """Runs each stream's open loop in its own process (a flood's client work must not
    delay the quiet stream's clock); gives every result and the longest wall time."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(_stream_in_process, url, s, seconds, seed + n, timeout)
                   for n, s in enumerate(streams)]
        parts = [f.result() for f in futures]
    return [r for results, _ in parts for r in results], max(w for _, w in parts)


async def closed_loop(url: str, stream: Stream, concurrency: int, seconds: float) -> float:
    """Gives completed requests per second at `concurrency` for `seconds` (capacity)."""
    done = 0
    deadline = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=None) as client:
        async def worker(n: int) -> None:
            nonlocal done
            rng = random.Random(1000 + n)
            while time.perf_counter() < deadline:
                result = await one(client, url, stream, rng, 120)
                done += result.status == 200
        start = time.perf_counter()
        await asyncio.gather(*(worker(n) for n in range(concurrency)))
        return done / (time.perf_counter() - start)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(results: list[Result], group: str, wall: float, slo_s: float | None = None) -> dict:
    mine = [r for r in results if r.group == group]
    ok = [r for r in mine if r.status == 200 and r.ttft is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    out = {"sent": len(mine), "ok": len(ok),
           "shed_429": sum(r.status == 429 for r in mine),
           "shed_with_retry_after": sum(r.status == 429 and r.retry_after is not None
                                        for r in mine),
           "lost": sum(r.status == 0 for r in mine), "hung": sum(r.status == -1 for r in mine),
           "other_errors": sum(r.status not in (0, -1, 200, 429) for r in mine),
           "ttft_p50_ms": 1000 * pct(ttfts, 0.5), "ttft_p99_ms": 1000 * pct(ttfts, 0.99),
           "completed_per_s": len(ok) / wall}
    if slo_s is not None:
        out["slo_attainment"] = sum(t <= slo_s for t in ttfts) / max(len(mine), 1)
    errors = [abs(r.predicted_ms / 1000 - r.ttft) / r.ttft for r in ok
              if r.predicted_ms is not None and r.ttft]
    if errors:
        out["predicted"] = len(errors)
        out["predictor_error_p50"] = pct(errors, 0.5)
        out["predictor_error_p90"] = pct(errors, 0.9)
    return out


def spread(values: list[float]) -> dict:
    """Gives the min, median and max of per-round values (the run-to-run spread)."""
    ordered = sorted(values)
    return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1],
            "rounds": values}


def run_noisy_or_priorities(kind: str, args: argparse.Namespace, log: Path) -> dict:
    """One fleet; capacity first, then `--rounds` rounds of (quiet stream alone, quiet
    stream beside the flood), alternating so that the host's drifting load hits both."""
    router = {"policy": "prefix-aware",
              "flowControl": {"maxQueuedPerFlow": 32, "maxQueuedRequests": 64,
                              "queueTimeoutSeconds": 20,
                              "reservedSlotsFraction": args.reserved_slots_fraction},
              "objectives": [{"name": "high", "priority": 10}, {"name": "low", "priority": 0}]}
    fleet = Fleet(manifest(1, router, args.max_num_batched_tokens), args.port, log / kind)
    alone: list[Result] = []
    both: list[Result] = []
    rounds: list[dict] = []
    pinned: list[str] = []
    try:
        fleet.wait_ready()
        if args.pin_engines:
            pinned = [*pin_engines(fleet.proc.pid), pin_router(fleet.proc.pid)]
        shape = {"words": (args.words, args.words + 20), "max_tokens": args.max_tokens}
        base = Stream("probe", 1.0, **shape)
        capacity = asyncio.run(closed_loop(fleet.url, base, 8, args.capacity_seconds))
        if kind == "noisy":
            quiet = Stream("B", 0.2 * capacity, {"x-gateway-inference-fairness-id": "B"}, **shape)
            loud = Stream("A", 3.0 * capacity, {"x-gateway-inference-fairness-id": "A"},
                          nice=args.flood_nice, **shape)
        else:
            quiet = Stream("high", 0.2 * capacity, {"x-gateway-inference-objective": "high",
                                                    "x-gateway-inference-fairness-id": "h"},
                           **shape)
            loud = Stream("low", 3.0 * capacity, {"x-gateway-inference-objective": "low",
                                                  "x-gateway-inference-fairness-id": "l"},
                          nice=args.flood_nice, **shape)
        for n in range(args.rounds):
            # new seeds every phase: no prompt repeats, so no phase hits the prefix cache
            one_alone, wall_alone = open_loops(fleet.url, [quiet], args.seconds, 100 * n + 10,
                                               args.client_timeout)
            one_both, wall_both = open_loops(fleet.url, [quiet, loud], args.seconds,
                                             100 * n + 50, args.client_timeout)
            alone += one_alone
            both += one_both
            a = summary(one_alone, quiet.group, wall_alone)
            b = summary(one_both, quiet.group, wall_both)
            rounds.append({"alone_p99_ms": a["ttft_p99_ms"], "under_load_p99_ms": b["ttft_p99_ms"],
                           "ratio": b["ttft_p99_ms"] / a["ttft_p99_ms"],
                           "loud_completed_per_s": summary(one_both, loud.group,
                                                           wall_both)["completed_per_s"]})
        metrics = httpx.get(fleet.url + "/metrics").text
    finally:
        fleet.close()
    seconds = args.rounds * args.seconds
    out = {"capacity_req_per_s": capacity, "pinned": pinned,
           "reserved_slots_fraction": args.reserved_slots_fraction,
           f"{quiet.group}_alone": summary(alone, quiet.group, seconds),
           f"{quiet.group}_under_load": summary(both, quiet.group, seconds),
           f"{loud.group}_under_load": summary(both, loud.group, seconds),
           "rounds": rounds,
           "flow_metrics": [line for line in metrics.splitlines()
                            if line.startswith(("kvpilot_router_flow_requests_total",
                                                "kvpilot_router_flow_queue_time_seconds_sum",
                                                "kvpilot_router_flow_queue_time_seconds_count"))]}
    p99_alone = out[f"{quiet.group}_alone"]["ttft_p99_ms"]
    out["ttft_p99_ratio"] = out[f"{quiet.group}_under_load"]["ttft_p99_ms"] / p99_alone
    out["ttft_p99_ratio_per_round"] = spread([r["ratio"] for r in rounds])
    return out


def processes() -> dict[int, tuple[int, list[str]]]:
    """Gives every process's (parent pid, command line) by pid."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")[:-1]
        except (OSError, ValueError, IndexError):
            continue
        out[int(stat.parent.name)] = (parent, [a.decode() for a in argv])
    return out


def router_argv(up_pid: int) -> list[str]:
    """Gives the command line of the router `kvpilot up` (pid `up_pid`) started."""
    for parent, argv in processes().values():
        if parent == up_pid and "route" in argv:
            return argv
    raise RuntimeError(f"no router among kvpilot up's ({up_pid}) children")


def pin_engines(up_pid: int) -> list[str]:
    """Pins each engine replica of `kvpilot up` (its API server and core processes) to a core
    of its own, so that two replicas on a small host are two servers, not one CPU shared;
    gives what it did."""
    table = processes()
    engines = sorted(pid for pid, (parent, argv) in table.items()
                     if parent == up_pid and "serve" in argv)
    done = []
    for n, engine in enumerate(engines):
        core = n % (os.cpu_count() or 1)
        tree = [engine] + [pid for pid, (parent, _) in table.items() if parent == engine]
        for pid in tree:
            subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(pid)], check=True,
                           capture_output=True)
        done.append(f"engine {engine} (+{len(tree) - 1} children) on core {core}")
    return done


def pin_router(up_pid: int) -> str:
    """Pins the router of `kvpilot up` (pid `up_pid`) to the host's last core, beside one
    engine on the first (`pin_engines`): on a small host the router relaying the flood's
    streams then takes no time from the engine's steps; gives what it did."""
    core = (os.cpu_count() or 1) - 1
    for pid, (parent, argv) in processes().items():
        if parent == up_pid and "route" in argv:
            subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(pid)], check=True,
                           capture_output=True)
            return f"router {pid} on core {core}"
    raise RuntimeError(f"no router among kvpilot up's ({up_pid}) children")


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def run_placement(args: argparse.Namespace, log: Path) -> dict:
    """One pair of engines behind two routers that differ only in --policy (the second
    started from the first's command line); rounds alternate the policies over the same
    arrival times and prompt lengths, with each policy's own prompt words (no prompt
    repeats: the same prefix-hit rate, about zero, for both)."""
    policies = ("prefix-aware", "predicted-latency")
    fleet = Fleet(manifest(2, {"policy": policies[0]}, args.max_num_batched_tokens), args.port,
                  log / "placement")
    second: subprocess.Popen[bytes] | None = None
    results: dict[str, list[Result]] = {p: [] for p in policies}
    rounds: list[dict] = []
    try:
        fleet.wait_ready()
        pinned = pin_engines(fleet.proc.pid) if args.pin_engines else []
        argv = with_flag(with_flag(router_argv(fleet.proc.pid), "--port", str(args.port + 1)),
                         "--policy", policies[1])
        with open(log / "placement" / "second-router.log", "wb") as router_log:
            second = subprocess.Popen(argv, stdout=router_log, stderr=subprocess.STDOUT)
        urls = {policies[0]: fleet.url, policies[1]: f"http://127.0.0.1:{args.port + 1}"}
        Fleet.wait_url(urls[policies[1]], second)
        chats = Stream("chat", args.chat_rate, words=(8, 24), max_tokens=args.chat_max_tokens)
        salts = {policy: "pq"[n] for n, policy in enumerate(policies)}  # as long, not equal
        streams = {policy: [chats, document_stream(args, salts[policy])] for policy in policies}
        for policy in policies:  # the same warm-up: it fills the models
            asyncio.run(open_loop(urls[policy], streams[policy], args.warmup_seconds, 7,
                                  args.client_timeout, salt=salts[policy]))
        for n in range(args.rounds):
            row: dict = {}
            for policy in policies if n % 2 == 0 else policies[::-1]:
                got, wall = asyncio.run(open_loop(urls[policy], streams[policy], args.seconds,
                                                  1000 + n, args.client_timeout,
                                                  salt=salts[policy]))
                results[policy] += got
                merged = [Result(**{**r.__dict__, "group": "all"}) for r in got]
                row[policy] = summary(merged, "all", wall, args.slo_ms / 1000)
            row["ttft_p99_improvement"] = (row[policies[0]]["ttft_p99_ms"]
                                           / row[policies[1]]["ttft_p99_ms"])
            rounds.append(row)
        hit_rates = {p: prefix_hit_rate(urls[p]) for p in policies}
        coefficients = [line for line in httpx.get(urls[policies[1]] + "/metrics").text
                        .splitlines() if line.startswith(("kvpilot_router_latency_model_coef",
                                                       "kvpilot_router_latency_model_speed"))]
    finally:
        if second is not None:
            second.send_signal(signal.SIGINT)
            second.wait(30)
        fleet.close()
    seconds = args.rounds * args.seconds
    out: dict = {"rounds": rounds, "latency_model": coefficients, "pinned": pinned}
    for policy in policies:
        got = results[policy]
        merged = [Result(**{**r.__dict__, "group": "all"}) for r in got]
        out[policy] = {"all": summary(merged, "all", seconds, args.slo_ms / 1000),
                       "chat": summary(got, "chat", seconds, args.slo_ms / 1000),
                       "document": summary(got, "document", seconds, args.slo_ms / 1000),
                       "router_prefix_hit_rate": hit_rates[policy]}
    base, pred = out[policies[0]]["all"], out[policies[1]]["all"]
    out["ttft_p99_improvement"] = base["ttft_p99_ms"] / pred["ttft_p99_ms"]
    out["ttft_p99_improvement_per_round"] = spread([r["ttft_p99_improvement"] for r in rounds])
    out["throughput_ratio"] = pred["completed_per_s"] / base["completed_per_s"]
    return out


def document_stream(args: argparse.Namespace, salt: str) -> Stream:
    """Gives the placement scenario's document requests: unique long prompts, or questions
    about `--shared-documents` documents of the policy's own words (`salt`), document i
    drawn with weight 1 / (i + 1) ** `--popularity-exponent`."""
    if not args.shared_documents:
        return Stream("document", args.doc_rate, words=(args.doc_words, args.doc_words + 100),
                      max_tokens=args.doc_max_tokens)
    rng = random.Random(99)
    documents = tuple(prompt(rng, args.doc_words + rng.randrange(101), salt)
                      for _ in range(args.shared_documents))
    popularity = tuple(1 / (i + 1) ** args.popularity_exponent
                       for i in range(args.shared_documents))
    return Stream("document", args.doc_rate, words=(args.question_words, args.question_words + 10),
                  max_tokens=args.doc_max_tokens, documents=documents, popularity=popularity)


def prefix_hit_rate(url: str) -> float:
    hits = queries = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("kvpilot_router_prefix_hit_blocks_total"):
            hits = float(line.split()[-1])
        if line.startswith("kvpilot_router_prompt_blocks_total"):
            queries = float(line.split()[-1])
    return hits / queries if queries else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--scenarios", default="noisy,priorities,placement")
    parser.add_argument("--seconds", type=float, default=20.0, help="each open-loop phase")
    parser.add_argument("--rounds", type=int, default=2,
                        help="noisy/priorities: rounds of (alone, under load); placement: "
                             "rounds of (prefix-aware, predicted-latency)")
    parser.add_argument("--reserved-slots-fraction", type=float, default=0.125,
                        help="noisy/priorities: spec.router.flowControl.reservedSlotsFraction")
    parser.add_argument("--flood-nice", type=int, default=0,
                        help="noisy/priorities: niceness added to the flood's client process "
                             "(19: the flood's client yields the host's cores to the fleet)")
    parser.add_argument("--capacity-seconds", type=float, default=15.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="the engines' step budget (maxNumBatchedTokens): a new request "
                             "waits out the step in progress")
    parser.add_argument("--warmup-seconds", type=float, default=15.0)
    parser.add_argument("--client-timeout", type=float, default=60.0,
                        help="a request unanswered this long counts as hung")
    parser.add_argument("--words", type=int, default=100,
                        help="noisy/priorities: prompt words (about 4 tokens each), +0..20")
    parser.add_argument("--max-tokens", type=int, default=48,
                        help="noisy/priorities: output tokens per request")
    parser.add_argument("--chat-rate", type=float, default=3.0)
    parser.add_argument("--doc-rate", type=float, default=1.0)
    parser.add_argument("--pin-engines", action=argparse.BooleanOptionalAction, default=True,
                        help="each engine replica on a core of its own (taskset); noisy and "
                             "priorities: the router on the last core")
    parser.add_argument("--doc-words", type=int, default=300,
                        help="placement: a document's words (+0..100)")
    parser.add_argument("--shared-documents", type=int, default=0,
                        help="placement: documents shared by the document requests (0: every "
                             "document prompt unique)")
    parser.add_argument("--popularity-exponent", type=float, default=1.0,
                        help="placement, shared documents: Zipf exponent of their popularity")
    parser.add_argument("--question-words", type=int, default=20,
                        help="placement, shared documents: a question's words (+0..10)")
    parser.add_argument("--chat-max-tokens", type=int, default=16)
    parser.add_argument("--doc-max-tokens", type=int, default=16)
    parser.add_argument("--slo-ms", type=float, default=1000.0)
    parser.add_argument("--port", type=int, default=18461)
    parser.add_argument("--out", default=str(RESULTS / f"flow_control-CPU-{datetime.date.today()}"))
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = Path(tempfile.mkdtemp(prefix="kvpilot-flow-logs-"))
    report: dict = {"date": str(datetime.date.today()),
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average "
                               f"{os.getloadavg()[0]:.1f} at start",
                    "command": " ".join(sys.argv), "logs": str(log)}
    for scenario in args.scenarios.split(","):
        started = time.perf_counter()
        if scenario == "placement":
            report[scenario] = run_placement(args, log)
        else:
            report[scenario] = run_noisy_or_priorities(scenario, args, log)
        report[scenario]["wall_seconds"] = round(time.perf_counter() - started, 1)
        (out_dir / "report.json").write_text(json.dumps(report, indent=2))
        print(json.dumps({scenario: report[scenario]}, indent=2), flush=True)


if __name__ == "__main__":
    main()
