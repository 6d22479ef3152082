"""`kvpilot bench throughput`: requests and tokens per second of the offline engine over a
dataset, as `vllm bench throughput` measures them.

All requests go to `LLM.generate` at once; the time is that call's (engine start-up
excluded). Each request samples (temperature 1, top-p 1) with EOS ignored, so it runs to its
output length. Tokens are counted from the outputs: the prompt token ids the engine saw and
every completion's token ids.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpilot.engine.benchmarks.offline_engine import (
    add_common_arguments,
    check_at_least,
    engine_args,
    generate,
    open_llm,
    shows_progress,
    token_counts,
    write_json,
)
from kvpilot.engine.loadgen.datasets import DATASETS, DatasetSpec

if TYPE_CHECKING:
    from kvpilot.engine.contracts.outputs import RequestOutput

DEFAULT_OUTPUT_LEN = 128  # the random datasets' output tokens when --output-len is not given


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `vllm bench throughput`'s flags: the dataset, the lengths, the engine's flags."""
    parser.add_argument("--dataset-name", choices=DATASETS, default="random")
    parser.add_argument("--dataset-path", type=Path, default=None,
                        help="ShareGPT-format JSON file (--dataset-name sharegpt)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1024,
                        help="prompt tokens (random and shared-prefix: the prompt's own part)")
    parser.add_argument("--output-len", type=int, default=None,
                        help=f"output tokens per request (default: {DEFAULT_OUTPUT_LEN}; "
                             "sharegpt: each reply's own length)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len*(1-r), len*(1+r)]")
    parser.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix dataset")
    parser.add_argument("--prefix-len", type=int, default=256, help="tokens per shared prefix")
    add_common_arguments(parser)


@dataclass(frozen=True)
class ThroughputResult:
    """What one run measured: its requests, their tokens, and the seconds they took."""

    elapsed_time: float
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int

    @property
    def total_num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def to_json(self) -> dict[str, Any]:
        """Gives vLLM's result keys, plus the prompt and output tokens apart."""
        return {**asdict(self), "total_num_tokens": self.total_num_tokens,
                "requests_per_second": self.num_requests / self.elapsed_time,
                "tokens_per_second": self.total_num_tokens / self.elapsed_time,
                "output_tokens_per_second": self.num_output_tokens / self.elapsed_time}


def summarize(outputs: list[RequestOutput], elapsed_time: float) -> ThroughputResult:
    """Gives the throughput of `outputs`, generated in `elapsed_time` seconds."""
    prompt_tokens, output_tokens = token_counts(outputs)
    return ThroughputResult(elapsed_time, len(outputs), prompt_tokens, output_tokens)


def format_result(result: ThroughputResult) -> str:
    """Gives the lines `vllm bench throughput` prints."""
    rates = result.to_json()
    return (f"Throughput: {rates['requests_per_second']:.2f} requests/s, "
            f"{rates['tokens_per_second']:.2f} total tokens/s, "
            f"{rates['output_tokens_per_second']:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {result.num_prompt_tokens}\n"
            f"Total num output tokens:  {result.num_output_tokens}")


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    """Gives the requests the dataset flags ask for."""
    output_len = args.output_len
    if output_len is None and args.dataset_name != "sharegpt":
        output_len = DEFAULT_OUTPUT_LEN
    return DatasetSpec(args.dataset_name, args.num_prompts, args.input_len, output_len,
                       args.random_range_ratio, args.num_prefixes, args.prefix_len,
                       args.dataset_path, args.seed)


def run(args: argparse.Namespace) -> int:
    """Runs the dataset through the offline engine and reports its throughput; gives the
    exit code."""
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.loadgen.datasets import sample_requests

    try:
        check_at_least(args, 1, "input_len", "n")
        if args.output_len is not None:
            check_at_least(args, 1, "output_len")
        spec = dataset_spec(args)
        engine = engine_args(args, "bench throughput")
        llm = open_llm(engine)
        try:
            samples = sample_requests(spec, llm.tokenizer)
            params = [SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True,
                                     max_tokens=s.output_len) for s in samples]
            start = time.perf_counter()
            outputs = generate(llm, [s.prompt for s in samples], params,
                               use_tqdm=shows_progress(args))
            elapsed = time.perf_counter() - start
        finally:
            llm.shutdown()  # stops a tensor-parallel engine's workers, frees its memory
    except ValueError as exc:
        print(f"kvpilot bench throughput: {exc}", file=sys.stderr)
        return 2
    result = summarize(outputs, elapsed)
    print(format_result(result))
    if args.output_json is not None:
        write_json(args.output_json, {
            "benchmark": "throughput", "dataset_name": spec.name, "num_prompts": spec.num_prompts,
            "input_len": spec.input_len, "output_len": spec.output_len, "n": args.n,
            "engine_args": asdict(engine), **result.to_json()})
    return 0
