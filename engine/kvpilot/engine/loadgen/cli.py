"""`kvpilot bench serve`: load-generate against an OpenAI-compatible server, report like vLLM.

Lengths are in tokens of the served model's tokenizer, as in `vllm bench serve`:
`--tokenizer`, else `--model`, else the model the server reports as its root (GET
/v1/models), whichever is a directory, a built-in config or a Hub id in the local
Hugging Face cache (never a download).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from kvpilot.engine.loadgen.datasets import DATASETS, DatasetSpec

if TYPE_CHECKING:
    from kvpilot.engine.contracts.tokenizer import TokenizerLike


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `kvpilot bench serve`'s flags (vLLM's names)."""
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the model name the server serves")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer for the token lengths: a model directory, a Hub id in "
                             "the local HF cache or a built-in (default: --model, else the "
                             "server's model root)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--endpoint", choices=("/v1/completions", "/v1/chat/completions"),
                        default="/v1/completions")
    parser.add_argument("--dataset-name", "--dataset", dest="dataset_name", choices=DATASETS,
                        default="random")
    parser.add_argument("--dataset-path", type=Path, default=None,
                        help="ShareGPT-format JSON file (--dataset-name sharegpt)")
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="output tokens per ShareGPT request (default: the reply's length)")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--random-output-len", type=int, default=64, help="max_tokens")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len*(1-r), len*(1+r)]")
    parser.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix dataset")
    parser.add_argument("--prefix-len", type=int, default=256, help="tokens per shared prefix")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second (inf: send all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the gaps: 1 is Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def _server_root(args: argparse.Namespace) -> str | None:
    """Gives the model root the server reports (GET /v1/models), or None."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        models = httpx.get(f"{args.base_url.rstrip('/')}/v1/models", headers=headers,
                           timeout=10).json()["data"]
        return next((m.get("root") for m in models if m.get("id") == args.model), None)
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def load_bench_tokenizer(args: argparse.Namespace) -> tuple[TokenizerLike, str]:
    """Gives the tokenizer the lengths count in and where it came from; raises ValueError
    naming --tokenizer when no candidate is local."""
    from kvpilot.engine.contracts.tokenizer import load_tokenizer
    from kvpilot.engine.models.hub_cache import local_model

    tried: list[str] = []
    candidates = [args.tokenizer] if args.tokenizer else [args.model, None]
    for name in candidates:
        name = name or _server_root(args)
        if not name:
            continue
        try:
            return load_tokenizer(local_model(name)), name
        except ValueError as exc:
            tried.append(f"{name}: {exc}")
    raise ValueError("lengths count in tokens of the served model's tokenizer, and none was "
                     "found locally: pass --tokenizer (a model directory, a Hub id in the local "
                     f"HF cache, or tiny-llama). Tried: {'; '.join(tried) or 'nothing'}")


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    """Gives the requests `--dataset-name` and its flags ask for."""
    return DatasetSpec(args.dataset_name, args.num_prompts, args.random_input_len,
                       args.sharegpt_output_len if args.dataset_name == "sharegpt"
                       else args.random_output_len,
                       args.random_range_ratio, args.num_prefixes, args.prefix_len,
                       args.dataset_path, args.seed)


def run(args: argparse.Namespace) -> int:
    from kvpilot.engine.contracts.streaming_gc import settle_gc
    from kvpilot.engine.entrypoints.event_loop import run_event_loop
    from kvpilot.engine.loadgen.datasets import sample_requests
    from kvpilot.engine.loadgen.report import RequestResult, format_table, parse_slos, summarize
    from kvpilot.engine.loadgen.runner import BenchConfig, run_benchmark

    try:
        slos = parse_slos(args.goodput)
        spec = dataset_spec(args)
        tokenizer, tokenizer_name = load_bench_tokenizer(args)
        samples = sample_requests(spec, tokenizer)
        cfg = BenchConfig(base_url=args.base_url.rstrip("/"), model=args.model,
                          request_rate=args.request_rate, burstiness=args.burstiness,
                          max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
                          api_key=args.api_key, timeout=args.timeout, seed=args.seed,
                          endpoint=args.endpoint)
        bar = None
        if not args.disable_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(samples), desc="requests", unit="req", file=sys.stderr)

        def done(_: RequestResult) -> None:
            if bar is not None:
                bar.update(1)

        # a GC pause of the event loop would be timed as the server's inter-token latency
        settle_gc()
        try:
            results, duration = run_event_loop(run_benchmark(cfg, samples, done))
        finally:
            if bar is not None:
                bar.close()
    except ValueError as exc:
        print(f"kvpilot bench serve: {exc}", file=sys.stderr)
        return 2
    summary = summarize(results, duration, slos)
    print(format_table(summary))
    if args.result_json is not None:
        record = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                  "base_url": args.base_url, "model": args.model, "tokenizer": tokenizer_name,
                  "endpoint": args.endpoint, "dataset": args.dataset_name,
                  "num_prompts": args.num_prompts,
                  "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
                  "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                  **summary}
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return 0 if summary["completed"] > 0 else 1
