"""Router policies on CPU: `prefix-aware` vs `round-robin` in front of four aggregated replicas.

Same run, same workload, fresh replicas for each policy: 8 shared system prompts
(1-2k tokens each) followed by 256 short user turns, sent at a fixed Poisson rate
through `kvpilot route` to four `kvpilot serve` tiny-llama replicas. Each replica's
KV cache holds about `--cache-prefixes` of the system prompts, as in a fleet
where the working set exceeds one replica's cache: round-robin makes every
replica see all 8 prompts and evict them, prefix-aware keeps each prompt on one
replica. Reports TTFT p50/p99, throughput and the engines' prefix-cache hit rate,
and writes bench/results/router_prefix.{json,md}.

    .venv/bin/python bench/router_prefix.py [--num-prompts 256] [--request-rate 2]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvpilot.engine.contracts.tokenizer import load_tokenizer
from kvpilot.engine.loadgen.datasets import shared_prefix_dataset
from kvpilot.engine.loadgen.report import summarize
from kvpilot.engine.loadgen.runner import BenchConfig, run_benchmark
from kvpilot.operator.local.plan import LocalProcess
from kvpilot.operator.local.supervisor import Supervisor, free_port

RESULTS = Path(__file__).parent / "results"
KVPILOT = [sys.executable, "-m", "kvpilot.cli.main"]
BLOCK = 16


def metric_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def engines_and_router(policy: str, args: argparse.Namespace, kv_blocks: int
                       ) -> tuple[list[LocalProcess], LocalProcess]:
    env = {"OMP_NUM_THREADS": str(args.threads)}  # four replicas share the cores evenly
    engines = []
    for i in range(args.replicas):
        port = free_port()
        engines.append(LocalProcess(f"engine-{i}", "both", [
            *KVPILOT, "serve", "--model", "tiny-llama", "--dtype", "float32",
            "--max-model-len", "4096", "--num-kv-blocks", str(kv_blocks),
            "--max-num-batched-tokens", "2048", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"], env, port))
    port = free_port()
    router = LocalProcess("router", "router", [
        *KVPILOT, "route", "--policy", policy, "--tokenizer", "tiny-llama",
        "--instances", ",".join(e.url for e in engines), "--refresh-interval", "0.5",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"], {}, port)
    return engines, router


def run_policy(policy: str, args: argparse.Namespace, kv_blocks: int, samples: list,
               saturating: list, log_dir: Path) -> dict:
    engines, router = engines_and_router(policy, args, kv_blocks)
    supervisor = Supervisor(log_dir / policy)
    (log_dir / policy).mkdir(parents=True, exist_ok=True)
    try:
        for process in [*engines, router]:
            supervisor.start(process)
        supervisor.wait_ready(300, {"router": "/ready"})
        cfg = BenchConfig(base_url=router.url, model="tiny-llama", request_rate=args.request_rate,
                          max_concurrency=args.max_concurrency, ignore_eos=True,
                          timeout=args.max_seconds, seed=args.seed)
        results, duration = asyncio.run(run_benchmark(cfg, samples))
        summary = summarize(results, duration)
        queries = hits = 0.0
        for engine in engines:
            text = httpx.get(engine.url + "/metrics").text
            queries += metric_sum(text, "vllm:prefix_cache_queries_total")
            hits += metric_sum(text, "vllm:prefix_cache_hits_total")
        summary["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
        if saturating:
            # Then capacity: the same fleet (caches in their steady state), closed loop.
            cfg.request_rate, cfg.max_concurrency = float("inf"), args.saturate_concurrency
            results, duration = asyncio.run(run_benchmark(cfg, saturating))
            summary["saturated"] = summarize(results, duration)
        return summary
    finally:
        supervisor.stop()


def markdown(report: dict) -> str:
    rows = ["| policy | TTFT p50 (ms) | TTFT p99 (ms) | req/s at the paced rate | prefix-cache "
            "hit rate | completed | saturated req/s | saturated output tok/s |",
            "|---|---|---|---|---|---|---|---|"]
    for policy, s in report["policies"].items():
        sat = s.get("saturated") or {"request_throughput": 0.0, "output_throughput": 0.0}
        rows.append(f"| {policy} | {s['median_ttft_ms']:.0f} | {s['p99_ttft_ms']:.0f} | "
                    f"{s['request_throughput']:.2f} | {s['prefix_cache_hit_rate']:.2f} | "
                    f"{s['completed']}/{report['num_prompts']} | "
                    f"{sat['request_throughput']:.2f} | {sat['output_throughput']:.1f} |")
    r = report["ratios"]
    return "\n".join([
        f"# Router policies on CPU ({report['date']})", "",
        f"Machine: {report['machine']}. Workload: {report['workload']}.", "",
        *rows, "",
        f"round-robin / prefix-aware: TTFT p50 {r['ttft_p50']:.1f}x, TTFT p99 "
        f"{r['ttft_p99']:.1f}x; prefix-aware / round-robin saturated throughput "
        f"{r['throughput']:.2f}x (goal: TTFT p50 >= 3x). TTFT comes from the paced run "
        f"(same Poisson arrivals for both); throughput from a closed loop of "
        f"{report['saturate_prompts']} more turns at concurrency {report['saturate_concurrency']}"
        " right after it, on the same replicas.", "",
        f"Reproduce: `{report['command']}`", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-words", type=int, default=700,
                        help="words per system prompt (the tiny tokenizer gives ~2 tokens/word)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--suffix-words", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--cache-prefixes", type=float, default=2.5,
                        help="system prompts one replica's KV cache holds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--max-seconds", type=float, default=600, help="per-request timeout")
    parser.add_argument("--saturate-prompts", type=int, default=128,
                        help="turns of the closed-loop throughput phase (0: skip it)")
    parser.add_argument("--saturate-concurrency", type=int, default=16)
    parser.add_argument("--policies", default="prefix-aware,round-robin")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    samples = shared_prefix_dataset(args.num_prompts, args.num_prefixes, args.prefix_words,
                                    args.suffix_words, args.output_len, 0.0, args.seed)
    prefixed = samples[:args.num_prefixes]  # request i uses system prompt i mod num_prefixes
    # Users arrive in random order: cyclic order would let round-robin pin each system
    # prompt to one replica whenever the replica count divides the prompt count.
    random.Random(args.seed).shuffle(samples)
    saturating = []
    if args.saturate_prompts:
        more = shared_prefix_dataset(args.num_prompts + args.saturate_prompts, args.num_prefixes,
                                     args.prefix_words, args.suffix_words, args.output_len, 0.0,
                                     args.seed)  # same system prompts, new user turns
        saturating = more[args.num_prompts:]
        random.Random(args.seed + 1).shuffle(saturating)
    tokenizer = load_tokenizer("tiny-llama")
    prefix_tokens = [len(tokenizer.encode(s.prompt)) - len(tokenizer.encode(
        " ".join(s.prompt.split()[args.prefix_words:]))) for s in prefixed]
    kv_blocks = int(args.cache_prefixes * max(prefix_tokens) / BLOCK) + 64
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"load average {os.getloadavg()[0]:.1f} at start (shared machine)",
        "workload": (f"{args.replicas} aggregated tiny-llama replicas (CPU, float32, "
                     f"{kv_blocks} KV blocks of {BLOCK} each), {args.num_prefixes} system "
                     f"prompts of {min(prefix_tokens)}-{max(prefix_tokens)} tokens, "
                     f"{args.num_prompts} user turns of {args.suffix_words} words, "
                     f"{args.output_len} output tokens, Poisson {args.request_rate} req/s"),
        "num_prompts": args.num_prompts,
        "saturate_prompts": args.saturate_prompts,
        "saturate_concurrency": args.saturate_concurrency,
        "command": "python bench/router_prefix.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "policies": {},
    }
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        for policy in args.policies.split(","):
            start = time.monotonic()
            report["policies"][policy] = run_policy(policy, args, kv_blocks, samples,
                                                    saturating, Path(tmp))
            print(f"{policy}: {time.monotonic() - start:.0f}s", flush=True)
    pa, rr = report["policies"].get("prefix-aware"), report["policies"].get("round-robin")
    if pa and rr:
        report["ratios"] = {
            "ttft_p50": rr["median_ttft_ms"] / max(pa["median_ttft_ms"], 1e-9),
            "ttft_p99": rr["p99_ttft_ms"] / max(pa["p99_ttft_ms"], 1e-9),
            "throughput": (pa.get("saturated") or pa)["output_throughput"] / max(
                (rr.get("saturated") or rr)["output_throughput"], 1e-9)}
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "router_prefix.json").write_text(json.dumps(report, indent=2))
        (RESULTS / "router_prefix.md").write_text(markdown(report))
        print(markdown(report))
    else:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
