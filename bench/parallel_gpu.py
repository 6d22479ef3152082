"""Issue 16: tensor parallelism on GPUs: batch-1 latency, batch-64 throughput, 70B roofline,
and the small all-reduce latency that holds TP decode back.

Llama-3-8B-shaped dummy model (bf16): batch-1 ms/token and batch-64 output tokens/s for
each TP size (default 1, 2, 4), every configuration in a fresh process (its engine starts
its own workers). Llama-3-70B-shaped (bf16, 141 GB) at TP=4: batch-1 ms/token against
its weight-read roofline (rank 0's weight bytes / measured device-copy bandwidth). NCCL
all-reduce latency of decode-sized messages, eager and replayed from a CUDA graph.
Goals (issue 16): TP=2 batch-1 >= 1.6x faster than TP=1; per-GPU batch-64 throughput
>= 80% of TP=1's; 70B TP=4 batch-1 >= 70% of its roofline.

    .venv/bin/python bench/parallel_gpu.py bench/results/parallel_gpu-4xH100 [--tp 1,2,4]
    .venv/bin/python bench/parallel_gpu.py /tmp/out --smoke   # CPU, tiny shapes, gloo, one process

Writes results.json and results.md into the directory; prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from cpu_smoke import one_thread_per_process  # bench/ is this script's sys.path[0]
from shapes import LLAMA3_8B, LLAMA3_70B, QWEN3_0_6B, write_model_dir

if TYPE_CHECKING:
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

TINY = {**LLAMA3_8B, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32}
SHAPES = {"8b": LLAMA3_8B, "70b": LLAMA3_70B, "0.6b": QWEN3_0_6B, "tiny": TINY}
RESULT_PREFIX = "RESULT "


def model_dir(root: Path, shape: str) -> Path:
    """Gives a model dir: the shape's config.json and a word-level tokenizer over its vocab."""
    return write_model_dir(root / f"llama-{shape}-shape", SHAPES[shape])


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: str, num_bytes: int) -> float:
    """Gives device-copy bandwidth in GB/s (bytes read plus written), median of 20 copies."""
    src = torch.randn(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        if i >= 5:
            times.append(time.perf_counter() - start)
    return 2 * num_bytes / statistics.median(times) / 1e9


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def measure(engine: LLMEngine, shape: str, batch: int, prompt_len: int,
            new_tokens: int) -> tuple[float, float, int]:
    """Gives (batch-1 ms/token, batch output tok/s, rank 0's weight bytes read per token)."""
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.executor.multi_rank_executor import MultiRankExecutor
    from kvpilot.engine.worker.model_runner import ModelRunner

    runner = engine.runner
    rank0 = runner.runner if isinstance(runner, MultiRankExecutor) else runner
    assert isinstance(rank0, ModelRunner)
    embed = rank0.model.model.embed_tokens.weight
    # a decode step reads one embedding row and every other weight of its rank
    weight_bytes = sum(p.numel() * p.element_size() for p in rank0.model.parameters()
                       if p is not embed)
    vocab = SHAPES[shape]["vocab_size"]
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=new_tokens)
    b1_ms = tok_s = 0.0
    for run in ("warm-up", "timed"):  # batch 1: time the tokens after the first
        engine.add_request(f"b1-{run}", prompts(1, prompt_len, vocab, 1)[0], greedy)
        engine.step()
        sync()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        sync()
        b1_ms = (time.perf_counter() - start) / (new_tokens - 1) * 1e3
    for run in ("warm-up", "timed"):  # the batch: every request runs to new_tokens
        for i, prompt in enumerate(prompts(batch, prompt_len, vocab, 2)):
            engine.add_request(f"b{batch}-{run}-{i}", prompt, greedy)
        sync()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        sync()
        tok_s = batch * new_tokens / (time.perf_counter() - start)
    return b1_ms, tok_s, weight_bytes


def run_config(shape: str, tp: int, smoke: bool) -> dict:
    """Gives one configuration's numbers; runs in its own process."""
    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

    device = "cpu" if smoke else "cuda"
    batch, prompt_len, new_tokens = (4, 16, 8) if smoke else (64, 128, 256)
    gbps = copy_bandwidth(device, (1 << 20) if smoke else (2 << 30))
    with tempfile.TemporaryDirectory() as root:
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=str(model_dir(Path(root), shape)), load_format="dummy", device=device,
            dtype="float32" if smoke else "bfloat16", tensor_parallel_size=tp,
            max_model_len=1024, max_num_seqs=batch, gpu_memory_utilization=0.85,
            kv_cache_memory="64MiB" if smoke else None))
        try:
            b1_ms, tok_s, weight_bytes = measure(engine, shape, batch, prompt_len, new_tokens)
            stats = engine.get_stats()
        finally:
            engine.shutdown()
    roofline_ms = weight_bytes / gbps / 1e6
    return {"shape": shape, "tp": tp, "device": device, "batch1_ms_per_token": b1_ms,
            f"batch{batch}_output_tok_per_s": tok_s, "per_gpu_tok_per_s": tok_s / tp,
            "weight_bytes_per_rank": weight_bytes, "copy_gbps": gbps,
            "roofline_ms": roofline_ms, "of_roofline": roofline_ms / b1_ms,
            "graph_steps": stats.graph_steps, "eager_steps": stats.eager_steps,
            "kv_blocks_per_rank": stats.num_total_blocks}


def allreduce_rank(rank: int, world: int, port: int, device_type: str, out: str) -> None:
    """One rank of the all-reduce latency measurement (rank 0 writes `out`)."""
    from kvpilot.engine.contracts.rendezvous import Rendezvous
    from kvpilot.engine.parallel.config import ParallelConfig
    from kvpilot.engine.parallel.distributed import destroy_distributed, init_distributed

    # one pipeline stage: the layer count only sizes stages, and no model is built here
    ctx = init_distributed(ParallelConfig(world), Rendezvous.local(world, port), rank,
                           device_type, num_layers=1)
    dtype = torch.float32 if device_type == "cpu" else torch.bfloat16
    rows = {}
    # a smoke run (CPU) only checks that the table fills: a tenth of the calls
    calls, warm_up = (220, 20) if device_type == "cuda" else (22, 2)
    for tokens, hidden in ((1, 4096), (1, 8192), (64, 4096), (64, 8192)):
        x = torch.ones(tokens, hidden, dtype=dtype, device=ctx.device)
        times = []
        for i in range(calls):
            sync()
            start = time.perf_counter()
            ctx.tp.all_reduce(x)
            sync()
            if i >= warm_up:
                times.append(time.perf_counter() - start)
        row = {"tokens": tokens, "hidden": hidden, "bytes": x.numel() * x.element_size(),
               "eager_us": statistics.median(times) * 1e6}
        if device_type == "cuda":  # what a decode graph replays: 100 all-reduces back to back
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(100):
                    ctx.tp.all_reduce(x)
            graph.replay()
            sync()
            start = time.perf_counter()
            for _ in range(10):
                graph.replay()
            sync()
            row["graph_us"] = (time.perf_counter() - start) / 1000 * 1e6
            graph.reset()  # before the groups go (pytorch/pytorch#115388)
        rows[f"{tokens}x{hidden}"] = row
    if rank == 0:
        Path(out).write_text(json.dumps({"world": world, "rows": list(rows.values())}))
    destroy_distributed()


def measure_allreduce(world: int, device_type: str) -> dict:
    """Gives all-reduce latencies over `world` fresh processes."""
    import multiprocessing

    from kvpilot.engine.executor.processes import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as root:
        out = str(Path(root) / "allreduce.json")
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=allreduce_rank, args=(r, world, port, device_type, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        if Path(out).exists():  # measured: a rank stuck leaving its groups does not matter
            for p in procs:
                if p.is_alive():
                    p.kill()
            return json.loads(Path(out).read_text())
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"all-reduce run of {world} ranks failed: "
                               f"{[p.exitcode for p in procs]}")
        return json.loads(Path(out).read_text())


def in_fresh_process(shape: str, tp: int) -> dict:
    """Gives run_config's GPU numbers from a fresh interpreter (GPUs 0..tp-1)."""
    argv = [sys.executable, __file__, "--run-config", f"{shape}:{tp}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{shape} TP={tp} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    # the engine's start-up line naming the all-reduce it chose (symmetric memory, fused)
    said = sorted({line for line in done.stderr.splitlines() if "all-reduce: " in line})
    print("\n".join(f"{shape} TP={tp}: {line}" for line in said), flush=True)
    return {**json.loads(lines[-1].removeprefix(RESULT_PREFIX)), "all_reduce_log": said}


def markdown(report: dict) -> str:
    out = [f"# Tensor parallelism ({report['machine']}, {report['date']})", "",
           f"Command: `{report['command']}`", "",
           "| run | model | TP | batch-1 ms/token | speed-up | batch tok/s | per GPU | per GPU vs TP=1 "
           "| % roofline | graph steps |", "|---|---|---|---|---|---|---|---|---|---|"]
    base = {r["label"]: r for r in report["configs"] if r["tp"] == 1}
    for r in report["configs"]:
        ref = base.get(r["label"])
        tok_s = next(v for k, v in r.items() if k.endswith("_output_tok_per_s"))
        speed = f"{ref['batch1_ms_per_token'] / r['batch1_ms_per_token']:.2f}x" if ref else "-"
        per = f"{r['per_gpu_tok_per_s'] / ref['per_gpu_tok_per_s']:.0%}" if ref else "-"
        out.append(f"| {r['label']} | {r['shape']} | {r['tp']} | {r['batch1_ms_per_token']:.2f} | {speed} "
                   f"| {tok_s:.0f} | {r['per_gpu_tok_per_s']:.0f} | {per} "
                   f"| {r['of_roofline']:.0%} | {r['graph_steps']} |")
    out += ["", "All-reduce latency (median, one op):", "",
            "| ranks | message | eager us | in a CUDA graph us |", "|---|---|---|---|"]
    for run in report["allreduce"]:
        for row in run["rows"]:
            graph = f"{row['graph_us']:.1f}" if "graph_us" in row else "-"
            out.append(f"| {run['world']} | {row['tokens']}x{row['hidden']} "
                       f"({row['bytes']} B) | {row['eager_us']:.1f} | {graph} |")
    return "\n".join(out) + "\n"


def config_numbers(shape: str, tp: int, smoke: bool) -> dict:
    """Gives one configuration's numbers: on GPUs from a fresh interpreter, which hands all
    its GPU memory back on exit; in a smoke run from this process, as a fresh interpreter's
    start-up is most of a tiny CPU configuration's time."""
    return run_config(shape, tp, smoke) if smoke else in_fresh_process(shape, tp)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, nargs="?", help="where results.json/.md go")
    parser.add_argument("--tp", default="1,2,4", help="TP sizes of the 8B-shaped runs ('' for none)")
    parser.add_argument("--no-70b", action="store_true", help="skip the 70B-shaped TP=4 run")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, gloo")
    parser.add_argument("--run-config", help=argparse.SUPPRESS)  # SHAPE:TP, in a child
    args = parser.parse_args()
    if args.smoke:
        one_thread_per_process()
    if args.run_config:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # on stderr
        shape, tp = args.run_config.split(":")
        print(RESULT_PREFIX + json.dumps(run_config(shape, int(tp), args.smoke)), flush=True)
        return 0
    if args.out_dir is None:
        parser.error("out_dir is required")
    # --tp "" runs no 8B configuration (the 70B run alone)
    tps = [1, 2] if args.smoke else [int(t) for t in args.tp.split(",") if t]
    shape = "tiny" if args.smoke else "8b"
    device_type = "cpu" if args.smoke else "cuda"
    report = {
        "machine": "CPU smoke run" if args.smoke else
        f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}",
        "date": datetime.date.today().isoformat(), "host": platform.node(),
        "torch": torch.__version__, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "configs": [], "allreduce": [],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def write() -> str:  # after every run, so a run cut short keeps what finished
        (args.out_dir / "results.json").write_text(json.dumps(report, indent=2))
        text = markdown(report)
        (args.out_dir / "results.md").write_text(text)
        return text

    # the all-reduce latencies first: they are quick and say what holds TP batch-1 back
    for world in sorted({tp for tp in tps if tp > 1}):
        report["allreduce"].append(measure_allreduce(world, device_type))
        write()
    for tp in tps:
        report["configs"].append({"label": "8b", **config_numbers(shape, tp, args.smoke)})
        write()
        print(f"done: {shape} TP={tp}", flush=True)
    if not args.no_70b:  # the smoke run stands in a tiny model at TP=2
        report["configs"].append({"label": "70b", **config_numbers(
            "tiny" if args.smoke else "70b", 2 if args.smoke else 4, args.smoke)})
    print(write())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
