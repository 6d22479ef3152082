"""`kvpilot bench latency`: the seconds the offline engine takes to generate one whole batch,
as `vllm bench latency` times them.

One batch of `--batch-size` prompts of exactly `--input-len` tokens (random text, drawn once
with `--seed`) runs to `--output-len` tokens each (sampling at temperature 1, EOS ignored),
`--num-iters-warmup` times untimed, then `--num-iters` times, each iteration one
`LLM.generate` call timed whole. As in vLLM every iteration sends the same prompts, so with
prefix caching on (the default) the later ones reuse the prompts' cached blocks;
`--no-enable-prefix-caching` times each prompt's prefill every time.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpilot.engine.benchmarks.offline_engine import (
    add_common_arguments,
    check_at_least,
    engine_args,
    generate,
    open_llm,
    progress,
    shows_progress,
    token_counts,
    write_json,
)

if TYPE_CHECKING:
    from kvpilot.engine.contracts.outputs import RequestOutput
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.entrypoints.llm import LLM

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `vllm bench latency`'s flags: the batch's shape, the iterations, the engine's."""
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts in the batch")
    parser.add_argument("--num-iters-warmup", type=int, default=10,
                        help="untimed iterations first")
    parser.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    add_common_arguments(parser)


@dataclass(frozen=True)
class LatencyResult:
    """The timed iterations' seconds, and the tokens one batch carried."""

    latencies: list[float]
    num_prompt_tokens: int
    num_output_tokens: int

    def to_json(self) -> dict[str, Any]:
        """Gives vLLM's result keys (avg_latency, latencies, percentiles), plus the tokens."""
        return {"avg_latency": float(np.mean(self.latencies)),
                "percentiles": {str(p): float(v) for p, v in
                                zip(PERCENTILES, np.percentile(self.latencies, PERCENTILES),
                                    strict=True)},
                **asdict(self)}


def format_result(result: LatencyResult) -> str:
    """Gives the lines `vllm bench latency` prints."""
    record = result.to_json()
    lines = [f"Avg latency: {record['avg_latency']} seconds"]
    lines += [f"{p}% percentile latency: {v} seconds" for p, v in record["percentiles"].items()]
    return "\n".join(lines)


def _time_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams
                ) -> tuple[float, list[RequestOutput]]:
    """Gives the seconds one generation of the whole batch took, and its outputs."""
    start = time.perf_counter()
    outputs = generate(llm, prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def run(args: argparse.Namespace) -> int:
    """Times the batch's generations and reports their latency; gives the exit code."""
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.loadgen.datasets import random_token_prompts

    bars = shows_progress(args)
    try:
        check_at_least(args, 1, "input_len", "output_len", "batch_size", "num_iters", "n")
        check_at_least(args, 0, "num_iters_warmup")
        engine = engine_args(args, "bench latency")
        llm = open_llm(engine)
        try:
            prompts = random_token_prompts(args.batch_size, args.input_len, args.seed,
                                           llm.tokenizer)
            params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True,
                                    max_tokens=args.output_len)
            for _ in progress(range(args.num_iters_warmup), args.num_iters_warmup,
                              "Warmup iterations", bars):
                _time_batch(llm, prompts, params)
            latencies: list[float] = []
            outputs: list[RequestOutput] = []
            for _ in progress(range(args.num_iters), args.num_iters, "Profiling iterations",
                              bars):
                seconds, outputs = _time_batch(llm, prompts, params)
                latencies.append(seconds)
        finally:
            llm.shutdown()  # stops a tensor-parallel engine's workers, frees its memory
    except ValueError as exc:
        print(f"kvpilot bench latency: {exc}", file=sys.stderr)
        return 2
    result = LatencyResult(latencies, *token_counts(outputs))
    print(format_result(result))
    if args.output_json is not None:
        write_json(args.output_json, {
            "benchmark": "latency", "batch_size": args.batch_size, "input_len": args.input_len,
            "output_len": args.output_len, "n": args.n, "num_iters_warmup":
            args.num_iters_warmup, "num_iters": args.num_iters, "engine_args": asdict(engine),
            **result.to_json()})
    return 0
