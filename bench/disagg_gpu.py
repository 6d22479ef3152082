"""Disaggregated vs aggregated serving on two GPUs, same run, same workload.

A: one prefill engine (GPU 0) + one decode engine (GPU 1) behind `kvpilot route`.
B: two aggregated engines (GPU 0, GPU 1) behind `kvpilot route --policy least-load`.
Workload: steady decodes (short prompts, long outputs) mixed with long prompts
(4-8k tokens, short outputs) that, when aggregated, stall the decodes sharing a
batch with them. Reports ITL p99 of the steady decodes and total throughput.
Goal (issue 6): ITL p99 >= 2x lower with A at <= 10% throughput cost.

The model is a Llama-3.2-1B-shaped config with dummy weights (no downloads) and the
bundled tiny tokenizer, so token counts are exact and nothing leaves the machine.

    python bench/disagg_gpu.py [--long-rate 0.5] [--decode-rate 4] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

from kvpilot.engine.loadgen.datasets import SampleRequest, random_dataset
from kvpilot.engine.loadgen.report import summarize
from kvpilot.engine.loadgen.runner import BenchConfig, run_benchmark
from kvpilot.engine.models.builtin import TINY_VOCAB_SIZE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from kvpilot.operator.local.plan import LocalProcess
from kvpilot.operator.local.supervisor import Supervisor, free_port

RESULTS = Path(__file__).parent / "results"
KVPILOT = [sys.executable, "-m", "kvpilot.cli.main"]
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": TINY_VOCAB_SIZE, "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 64, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": True, "bos_token_id": 1,
            "eos_token_id": [0, 3]}


def write_model(root: Path) -> Path:
    """Gives a model dir: the 1B-shaped config plus the bundled tokenizer files."""
    path = root / "llama-1b-shape"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA_1B))
    shutil.copy(TOKENIZER_FILE, path / "tokenizer.json")
    shutil.copy(TOKENIZER_CONFIG_FILE, path / "tokenizer_config.json")
    return path


def engine(name: str, role: str, gpu: int, model: Path) -> LocalProcess:
    port = free_port()
    return LocalProcess(name, role, [
        *KVPILOT, "serve", "--model", str(model), "--served-model-name", "bench",
        "--load-format", "dummy", "--dtype", "bfloat16", "--device", "cuda",
        "--max-model-len", "12288", "--max-num-batched-tokens", "8192", "--role", role,
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        {"CUDA_VISIBLE_DEVICES": str(gpu)}, port)


def router(engines: list[LocalProcess], policy: str) -> LocalProcess:
    port = free_port()
    return LocalProcess("router", "router", [
        *KVPILOT, "route", "--policy", policy, "--instances",
        ",".join(f"{e.role}={e.url}" for e in engines), "--refresh-interval", "0.5",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"], {}, port)


def workloads(args: argparse.Namespace) -> tuple[list[SampleRequest], list[SampleRequest]]:
    """Gives (long prompts, steady decodes) sized to last about `args.seconds`."""
    n_long = max(1, int(args.long_rate * args.seconds))
    n_decode = max(1, int(args.decode_rate * args.seconds))
    # ~2 tokens per word with the tiny tokenizer: 2-4k words is 4-8k tokens
    long = random_dataset(n_long, 3000, 16, 1 / 3, args.seed)
    decode = random_dataset(n_decode, 64, 256, 0.0, args.seed + 1)
    return long, decode


async def drive(url: str, args: argparse.Namespace) -> dict:
    long, decode = workloads(args)
    long_cfg = BenchConfig(url, "bench", request_rate=args.long_rate, ignore_eos=True,
                           seed=args.seed)
    decode_cfg = BenchConfig(url, "bench", request_rate=args.decode_rate, ignore_eos=True,
                             seed=args.seed + 1)
    (long_res, long_t), (dec_res, dec_t) = await asyncio.gather(
        run_benchmark(long_cfg, long), run_benchmark(decode_cfg, decode))
    duration = max(long_t, dec_t)
    return {"decodes": summarize(dec_res, dec_t), "long_prompts": summarize(long_res, long_t),
            "all": summarize(long_res + dec_res, duration)}


def run_config(name: str, processes: list[LocalProcess], log_dir: Path,
               args: argparse.Namespace) -> dict:
    supervisor = Supervisor(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for process in processes:
            supervisor.start(process)
        supervisor.wait_ready(600, {"router": "/ready"})
        warm = random_dataset(4, 100, 8, 0.0, 99)  # compile/warm-up both engines
        asyncio.run(run_benchmark(BenchConfig(processes[-1].url, "bench"), warm))
        return asyncio.run(drive(processes[-1].url, args))
    finally:
        supervisor.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--long-rate", type=float, default=0.5, help="long prompts per second")
    parser.add_argument("--decode-rate", type=float, default=4.0, help="decodes per second")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    random.seed(args.seed)
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    report: dict = {"date": datetime.date.today().isoformat(), "gpu": f"2x {gpu}",
                    "args": vars(args), "configs": {}}
    with tempfile.TemporaryDirectory(prefix="disagg-bench-") as tmp:
        model = write_model(Path(tmp))
        pd = [engine("prefill", "prefill", 0, model), engine("decode", "decode", 1, model)]
        agg = [engine("agg-0", "both", 0, model), engine("agg-1", "both", 1, model)]
        report["configs"]["disaggregated"] = run_config(
            "disaggregated", [*pd, router(pd, "prefix-aware")], Path(tmp) / "pd", args)
        report["configs"]["aggregated"] = run_config(
            "aggregated", [*agg, router(agg, "least-load")], Path(tmp) / "agg", args)
    d, a = report["configs"]["disaggregated"], report["configs"]["aggregated"]
    report["ratios"] = {
        "itl_p99_agg_over_disagg": a["decodes"]["p99_itl_ms"] / max(d["decodes"]["p99_itl_ms"],
                                                                    1e-9),
        "throughput_disagg_over_agg": d["all"]["output_throughput"] / max(
            a["all"]["output_throughput"], 1e-9)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "disagg_gpu.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Disaggregated vs aggregated on {report['gpu']} ({report['date']})", "",
             "| config | decode ITL p50 (ms) | decode ITL p99 (ms) | long-prompt TTFT p50 (ms) "
             "| output tok/s |", "|---|---|---|---|---|"]
    for name, c in report["configs"].items():
        lines.append(f"| {name} | {c['decodes']['median_itl_ms']:.1f} | "
                     f"{c['decodes']['p99_itl_ms']:.1f} | "
                     f"{c['long_prompts']['median_ttft_ms']:.0f} | "
                     f"{c['all']['output_throughput']:.0f} |")
    r = report["ratios"]
    lines += ["", f"ITL p99 aggregated / disaggregated: {r['itl_p99_agg_over_disagg']:.2f}x; "
              f"throughput disaggregated / aggregated: {r['throughput_disagg_over_agg']:.2f}x "
              "(goal: >= 2x and >= 0.9x)", ""]
    (RESULTS / "disagg_gpu.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
