"""Host-tier KV restore vs recompute: TTFT of a long prompt whose blocks were evicted from the
GPU prefix cache, in an engine with `--kv-offload-gb` (loaded back from host memory) and
in one without (recomputed). Issue 22's goal: restored >= 3x faster for a 4k-token prefix.

One engine per mode, in this process, on one GPU: a Llama-3-8B-shaped (`--shape 8b`) or
Llama-3.2-1B-shaped dummy model (bench/disagg_gpu.py's shapes), a KV cache of
`--gpu-blocks` blocks. Per repeat: a fresh random prompt of `--tokens` tokens runs once
(its blocks cached), filler prompts evict every one of its blocks, then the prompt runs
again with max_tokens=1 and its TTFT (add_request to the first token) is taken. The
report gives both modes' medians, their ratio, the blocks the host tier loaded (the
proof that the restore happened) and whether both modes' second runs gave the same first
tokens (bf16 on a GPU may flip a near-tie between a restored and a recomputed batch).

    python bench/kv_tier_gpu.py [--shape 8b] [--tokens 4096] [--repeat 5] [--out DIR]
    python bench/kv_tier_gpu.py --smoke --out DIR   # CPU, tiny shape: checks the script only

Results: <out>/kv_tier_gpu-<shape>.{json,md} (default bench/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_smoke import one_thread_per_process  # sibling scripts
from disagg_gpu import SHAPES, write_model

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine

RESULTS = Path(__file__).parent / "results"
BLOCK = 16
FIRST_TOKENS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TTFT_ONLY = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
MAX_STEPS = 10_000  # every loop is bounded


def run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams
        ) -> tuple[float, list[int]]:
    """Runs one request to its end; gives (seconds to its first token, its token ids)."""
    started, first, tokens = time.perf_counter(), None, []
    engine.add_request(request_id, prompt, params)
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            tokens += output.completions[0].token_ids
            if first is None and tokens:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"request {request_id} gave no token in {MAX_STEPS} steps")
    return first, tokens


def measure(args: argparse.Namespace, model: Path, offload_gb: float) -> dict:
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model), load_format="dummy", device=args.device, dtype=args.dtype,
        block_size=BLOCK, num_kv_blocks=args.gpu_blocks, kv_offload_gb=offload_gb,
        max_num_batched_tokens=max(8192, args.tokens + 1)))
    rng = random.Random(0)
    vocab = SHAPES[args.shape]["vocab_size"]

    def prompt() -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(args.tokens + 1)]

    run(engine, "warmup", prompt(), FIRST_TOKENS)  # compiles kernels, captures graphs
    ttfts, firsts = [], []
    fillers = -(-args.gpu_blocks * BLOCK // args.tokens) + 1  # evict everything cached
    for index in range(args.repeat):
        tokens = prompt()
        run(engine, f"p{index}", tokens, TTFT_ONLY)
        for filler in range(fillers):
            run(engine, f"f{index}-{filler}", prompt(), TTFT_ONLY)
        if args.device == "cuda":
            torch.cuda.synchronize()
        ttft, again = run(engine, f"again{index}", tokens, FIRST_TOKENS)
        ttfts.append(ttft)
        firsts.append(again)
    stats = engine.get_stats()
    return {"kv_offload_gb": offload_gb, "ttft_s": ttfts, "ttft_median_s": statistics.median(ttfts),
            "first_tokens": firsts, "loaded_blocks": stats.kv_offload_loaded_blocks,
            "saved_blocks": stats.kv_offload_saved_blocks,
            "failed_blocks": stats.kv_offload_failed_blocks,
            "external_hit_tokens": stats.external_prefix_cache_hits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens (the prefix)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--gpu-blocks", type=int, default=1024,
                        help="KV blocks on the GPU (small, so fillers evict the prompt)")
    parser.add_argument("--offload-gb", type=float, default=6.0,
                        help="host tier size: room for the prompt and every filler")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny shape, short prompt: a check of the script, no numbers")
    args = parser.parse_args()
    if args.smoke:
        one_thread_per_process()
        args.shape, args.device, args.dtype = "tiny", "cpu", "float32"
        args.tokens, args.repeat, args.gpu_blocks, args.offload_gb = 128, 1, 32, 0.01
    report: dict = {"date": datetime.date.today().isoformat(), "shape": args.shape,
                    "device": (torch.cuda.get_device_name() if args.device == "cuda"
                               else "cpu"),
                    "tokens": args.tokens, "gpu_blocks": args.gpu_blocks, "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp), args.shape)
        report["modes"]["recompute"] = measure(args, model, 0.0)
        report["modes"]["host"] = measure(args, model, args.offload_gb)
    recompute, host = report["modes"]["recompute"], report["modes"]["host"]
    report["speedup"] = recompute["ttft_median_s"] / host["ttft_median_s"]
    report["same_first_tokens"] = recompute["first_tokens"] == host["first_tokens"]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"kv_tier_gpu-{args.shape}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [f"# Host-tier restore vs recompute, {args.tokens}-token prompt, {args.shape} shape, "
             f"{report['device']} ({report['date']})", "",
             "| mode | TTFT median (ms) | blocks loaded from host |", "|---|---|---|",
             f"| recomputed | {recompute['ttft_median_s'] * 1e3:.1f} | "
             f"{recompute['loaded_blocks']} |",
             f"| restored from host | {host['ttft_median_s'] * 1e3:.1f} | "
             f"{host['loaded_blocks']} |", "",
             f"Speedup {report['speedup']:.2f}x (goal >= 3x); same first tokens: "
             f"{report['same_first_tokens']}."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
