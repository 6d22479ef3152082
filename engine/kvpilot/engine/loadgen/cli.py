"""`kvpilot bench serve`: load-generate against an OpenAI-compatible server, report like vLLM."""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import UTC, datetime
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    serve = sub.add_parser("serve", help="stream completions at a server and time them")
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", required=True, help="the model name the server serves")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--endpoint", choices=("/v1/completions", "/v1/chat/completions"),
                       default="/v1/completions")
    serve.add_argument("--dataset", choices=("random", "shared-prefix"), default="random")
    serve.add_argument("--num-prompts", type=int, default=100)
    serve.add_argument("--random-input-len", type=int, default=128, help="words per prompt")
    serve.add_argument("--random-output-len", type=int, default=64, help="max_tokens")
    serve.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="lengths uniform in [len*(1-r), len*(1+r)]")
    serve.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix dataset")
    serve.add_argument("--prefix-len", type=int, default=256, help="words per shared prefix")
    serve.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests per second (inf: send all at once)")
    serve.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of the gaps: 1 is Poisson")
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--ignore-eos", action="store_true")
    serve.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                       help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000")
    serve.add_argument("--result-json", type=Path, default=None)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kvpilot.engine.loadgen.datasets import random_dataset, shared_prefix_dataset
    from kvpilot.engine.loadgen.report import format_table, parse_slos, summarize
    from kvpilot.engine.loadgen.runner import BenchConfig, run_benchmark

    try:
        slos = parse_slos(args.goodput)
        if args.dataset == "random":
            samples = random_dataset(args.num_prompts, args.random_input_len,
                                     args.random_output_len, args.random_range_ratio, args.seed)
        else:
            samples = shared_prefix_dataset(args.num_prompts, args.num_prefixes,
                                            args.prefix_len, args.random_input_len,
                                            args.random_output_len, args.random_range_ratio,
                                            args.seed)
        cfg = BenchConfig(base_url=args.base_url.rstrip("/"), model=args.model,
                          request_rate=args.request_rate, burstiness=args.burstiness,
                          max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
                          api_key=args.api_key, timeout=args.timeout, seed=args.seed,
                          endpoint=args.endpoint)
        results, duration = asyncio.run(run_benchmark(cfg, samples))
    except ValueError as exc:
        print(f"kvpilot bench serve: {exc}", file=sys.stderr)
        return 2
    summary = summarize(results, duration, slos)
    print(format_table(summary))
    if args.result_json is not None:
        record = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                  "base_url": args.base_url, "model": args.model, "endpoint": args.endpoint,
                  "dataset": args.dataset,
                  "num_prompts": args.num_prompts,
                  "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
                  "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                  **summary}
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return 0 if summary["completed"] > 0 else 1
