"""Server overhead: the same workload through LLMEngine directly and through `kvpilot serve`.

Prefix caching off. First the offline loop in this process (add every request,
step until done), then the same prompts streamed over HTTP to a `kvpilot serve`
subprocess by the `kvpilot bench serve` runner (all sent at once, `ignore_eos`,
fixed output length), side by side in one run; each gets the same warm-up. Prints output
tokens/s of both and their ratio (server / offline; 1.0 = no overhead), plus
the server's TTFT/ITL, and writes JSON and a markdown table to bench/results/.

    .venv/bin/python bench/serve_overhead.py [--num-prompts 32] [--input-len 64]
        [--output-len 64] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.loadgen.datasets import SampleRequest, random_word_dataset
from kvpilot.engine.loadgen.report import summarize
from kvpilot.engine.loadgen.runner import BenchConfig, run_benchmark

RESULTS = Path(__file__).parent / "results"
MODEL = "tiny-llama"
# A fixed KV pool for both runs, so the offline engine does not hold the GPU's memory
# while the server process starts.
NUM_KV_BLOCKS = 8192


def offline(engine: LLMEngine, prompts: list[str], output_len: int) -> tuple[int, float]:
    """Gives (output tokens, seconds) of the engine loop, run on its own thread as the server does.

    The thread matters: OpenMP thread settings are per thread, and on a busy CPU the
    main thread's team of torch intra-op threads ran the same loop 20-30x slower than
    a fresh thread did here, which would make the comparison about threads, not HTTP.
    """
    result: list[tuple[int, float]] = []
    thread = threading.Thread(target=lambda: result.append(_offline(engine, prompts,
                                                                    output_len)))
    thread.start()
    thread.join()
    return result[0]


def _offline(engine: LLMEngine, prompts: list[str], output_len: int) -> tuple[int, float]:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"offline-{i}-{start}", prompt, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():  # each holds the request's new tokens
            tokens += sum(len(c.token_ids) for c in delta.completions)
    return tokens, time.perf_counter() - start


def served(samples: list[SampleRequest], device: str, log: Path) -> dict[str, Any]:
    """Gives the loadgen summary of `samples` sent to a `kvpilot serve` subprocess."""
    flags = ["--model", MODEL, "--device", device, "--no-enable-prefix-caching",
             "--max-model-len", "1024", "--num-kv-blocks", str(NUM_KV_BLOCKS),
             "--port", "0", "--log-level", "warning"]
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpilot.cli", "serve", *flags],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        base = _wait_ready(proc, log)
        cfg = BenchConfig(base_url=base, model=MODEL, ignore_eos=True)
        asyncio.run(run_benchmark(cfg, samples[:4]))  # warm-up, as offline gets
        results, duration = asyncio.run(run_benchmark(cfg, samples))
        return summarize(results, duration)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _wait_ready(proc: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))
        if found:
            try:
                if httpx.get(f"{found.group(1)}/ready", timeout=2).status_code == 200:
                    return found.group(1)
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            raise RuntimeError(f"kvpilot serve exited:\n{log.read_text()}")
        time.sleep(0.1)
    raise RuntimeError(f"kvpilot serve did not become ready:\n{log.read_text()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64, help="words per prompt")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tag", default="", help="suffix of the result files' names")
    args = parser.parse_args()

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=MODEL, device=args.device, enable_prefix_caching=False, max_model_len=1024,
        num_kv_blocks=NUM_KV_BLOCKS))
    samples = random_word_dataset(args.num_prompts, args.input_len, args.output_len, 0.0, seed=0)
    prompts = [s.prompt for s in samples]
    offline(engine, prompts[:4], 4)  # warm-up: first-call allocations, lazy imports
    off_tokens, off_s = offline(engine, prompts, args.output_len)
    del engine  # the server process loads its own
    with tempfile.TemporaryDirectory() as tmp:
        summary = served(samples, args.device, Path(tmp) / "serve.log")
    off_tps = off_tokens / off_s
    ratio = summary["output_throughput"] / off_tps
    device = (torch.cuda.get_device_name() if torch.cuda.is_available() and
              args.device != "cpu" else f"CPU ({platform.processor() or platform.machine()})")
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": device, "torch_threads": torch.get_num_threads(), "model": MODEL,
        "num_prompts": args.num_prompts, "input_words": args.input_len,
        "output_len": args.output_len,
        "offline_output_tok_s": off_tps, "offline_seconds": off_s,
        "served_output_tok_s": summary["output_throughput"],
        "served_seconds": summary["duration"], "served_failed": summary["failed"],
        "ratio_served_over_offline": ratio,
        "served_mean_ttft_ms": summary["mean_ttft_ms"],
        "served_median_itl_ms": summary["median_itl_ms"],
        "served_p99_itl_ms": summary["p99_itl_ms"],
    }
    print(json.dumps(record, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"serve_overhead{'_' + args.tag if args.tag else ''}"
    (args.out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(
        f"# Server overhead ({record['date']}, {device}, {MODEL})\n\n"
        f"{args.num_prompts} prompts of {args.input_len} words, {args.output_len} output "
        "tokens each (ignore_eos), all sent at once; prefix caching off.\n\n"
        "| path | output tok/s | seconds |\n|---|---|---|\n"
        f"| LLMEngine loop (offline) | {off_tps:.1f} | {off_s:.2f} |\n"
        f"| HTTP streaming to a `kvpilot serve` process | {summary['output_throughput']:.1f} | "
        f"{summary['duration']:.2f} |\n\n"
        f"Ratio served / offline: **{ratio:.2f}**. Served mean TTFT "
        f"{summary['mean_ttft_ms']:.0f} ms, median ITL {summary['median_itl_ms']:.1f} ms.\n"
        "Reproduce: `python bench/serve_overhead.py --num-prompts "
        f"{args.num_prompts} --input-len {args.input_len} --output-len {args.output_len}`\n")


if __name__ == "__main__":
    main()
