"""Where a batch-1 decode step's time goes, at TP=1 and TP=2 (issues 16 and 21).

The Llama-3-8B-shaped dummy engine of bench/parallel_gpu.py, one fresh process per TP
size; after a warm-up, torch.profiler records `--steps` engine steps of one request's
decode (CUDA graphs replayed as the engine runs them). Reported per step on rank 0: wall
ms, kernels launched, the GPU's busy ms (union of kernel intervals) and its idle ms, and
the kernels taking the most time; a gzipped Chrome trace per TP size goes to OUT.

With `--chunk N` every profiled step also prefills a new request's N-token prompt beside
the decodes: a mixed step, which runs eagerly (issue 21: such steps took 18-40 ms of host
time on an H100 in Poisson serving). Then `--steps` more such steps run under cProfile
and the Python functions with the most own time are printed: where the host's time goes.
Last, mixed steps with chunk sizes 1..4N, each size twice: the median and worst step time
the first time a size runs against the second time (does a new token count cost extra?).

    python bench/step_profile_gpu.py OUT [--tp 1,2] [--steps 32] [--batch 1] [--quantization int8]
    python bench/step_profile_gpu.py OUT --tp 1 --shape 0.6b --batch 64 --chunk 12
    python bench/step_profile_gpu.py /tmp/out --smoke --steps 4   # CPU, tiny: checks the script
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import json
import pstats
import random
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from fresh_process import ChildFailed, call_in_fresh_process  # bench/ is sys.path[0]


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Gives the length of the union of (start, end) µs intervals, in ms."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total / 1e3


def first_seen_shapes(step, chunk: int, vocab: int) -> dict[str, float]:
    """Times mixed steps whose prefill chunk has a size not run before against steps repeating
    a size (each of 1..4*chunk twice, in shuffled passes, synchronised after every step):
    whether a step pays for the first use of its token count (GEMM shapes new to cuBLAS,
    kernels not yet loaded), as the first decode step of each batch size paid for the LM
    head before the start-up warm-up (bench/results/serve_vs_offline-H100-2026-11-27/)."""
    from parallel_gpu import prompts, sync

    rng = random.Random(5)
    sizes = [size for size in range(1, 4 * chunk + 1) if size != chunk]  # chunk: warmed
    sizes = rng.sample(sizes, min(len(sizes), 48))  # bounded: an eager step can take 40 ms
    walls: dict[str, list[float]] = {"first": [], "repeat": []}
    for kind in walls:
        rng.shuffle(sizes)
        for size in sizes:
            [prompt] = prompts(1, size, vocab, rng.randrange(1 << 30))
            started = time.perf_counter()
            step(prompt)
            sync()
            walls[kind].append(1e3 * (time.perf_counter() - started))
    return {f"{kind}_ms_{stat}": round(fn(ms), 3) for kind, ms in walls.items()
            for stat, fn in (("median", statistics.median), ("max", max))} | {
        "sizes": len(sizes)}


def allocator_counts() -> dict[str, int]:
    """Gives the CUDA caching allocator's cumulative device allocs, frees and retries."""
    if not torch.cuda.is_available():
        return {"num_device_alloc": 0, "num_device_free": 0, "num_alloc_retries": 0}
    stats = torch.cuda.memory_stats()
    return {name: int(stats.get(name, 0))
            for name in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def profile(tp: int, steps: int, batch: int, out: Path, smoke: bool,
            quantization: str | None, chunk: int = 0, shape: str = "8b") -> dict:
    from parallel_gpu import SHAPES, model_dir, prompts, sync
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

    shape = "tiny" if smoke else shape
    vocab = SHAPES[shape]["vocab_size"]
    arrivals = iter(prompts(3 * steps, max(chunk, 1), vocab, 11))
    with tempfile.TemporaryDirectory() as root:
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=str(model_dir(Path(root), shape)), load_format="dummy",
            device="cpu" if smoke else "cuda", dtype="float32" if smoke else "bfloat16",
            tensor_parallel_size=tp, max_num_seqs=batch + 8,  # room for the chunks
            max_model_len=max(1024, 256 + 6 * steps + 64 + 8 * chunk),
            gpu_memory_utilization=0.85, kv_cache_memory="64MiB" if smoke else None,
            quantization=quantization or "none"))
        try:
            greedy = SamplingParams(temperature=0, ignore_eos=True,
                                    max_tokens=6 * steps + 64 + 8 * chunk)
            for i, prompt in enumerate(prompts(batch, 128, vocab, 3)):
                engine.add_request(f"p{i}", prompt, greedy)
            arrived = 0

            def step(prompt: list[int] | None = None) -> None:
                nonlocal arrived
                if chunk:  # a new prompt each step: decodes beside an N-token prefill
                    engine.add_request(f"chunk{arrived}", prompt or next(arrivals),
                                       SamplingParams(temperature=0, max_tokens=1))
                    arrived += 1
                engine.step()

            for _ in range(2 * steps if not chunk else 0):  # prefill, then warm decode steps
                engine.step()
            for _ in range(steps if chunk else 0):  # prefill, then warm mixed steps
                step()
            sync()
            allocator_before = allocator_counts()
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                started = time.perf_counter()
                for _ in range(steps):
                    step()
                sync()
                wall = time.perf_counter() - started
            # cudaMalloc/cudaFree calls and the allocator's free-everything-and-retry path
            # (which waits for the device) during the profiled steps: 0 when the caching
            # allocator serves every step from what it holds
            allocator = {name: count - allocator_before[name]
                         for name, count in allocator_counts().items()}
            host_top, first_seen = [], {}
            if chunk:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(steps):
                    step()
                sync()
                profiler.disable()
                stats = pstats.Stats(profiler)
                rows = [(tottime, calls, f"{Path(file).name}:{line}:{name}")
                        for (file, line, name), (_, calls, tottime, _, _)
                        in stats.stats.items()]  # pyright: ignore[reportAttributeAccessIssue]
                host_top = [{"where": where, "calls_per_step": calls / steps,
                             "ms_per_step": 1e3 * tottime / steps}
                            for tottime, calls, where in sorted(rows, reverse=True)[:25]]
                first_seen = first_seen_shapes(step, chunk, vocab)
        finally:
            engine.shutdown()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = defaultdict(list)
    for event in kernels:
        by_name[event.name].append(event.time_range.end - event.time_range.start)
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    gpu_busy = busy_ms(spans) / steps
    trace = out / f"trace-tp{tp}-b{batch}-c{chunk}-{quantization or 'bf16'}.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:15]
    return {"tp": tp, "batch": batch, "quantization": quantization, "steps": steps,
            "shape": shape, "chunk": chunk, "host_top": host_top, "allocator": allocator,
            "first_seen": first_seen,
            "wall_ms_per_step": wall / steps * 1e3,
            "kernels_per_step": len(kernels) / steps,
            "kernel_ms_per_step": sum(e.time_range.end - e.time_range.start
                                      for e in kernels) / steps / 1e3,
            "gpu_busy_ms_per_step": gpu_busy,
            "gpu_idle_ms_per_step": wall / steps * 1e3 - gpu_busy,
            "top": [{"name": name[:90], "count_per_step": len(d) / steps,
                     "us_mean": sum(d) / len(d), "ms_per_step": sum(d) / steps / 1e3}
                    for name, d in top]}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--quantization", choices=["int8", "fp8"])
    parser.add_argument("--chunk", type=int, default=0,
                        help="a new N-token prompt prefilled in every profiled step (mixed steps)")
    parser.add_argument("--shape", default="8b", help="a model shape of bench/parallel_gpu.py")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape: checks the script")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    label = args.quantization or "bf16"
    results = []
    for tp in (int(t) for t in args.tp.split(",")):
        try:  # each TP size in its own process: its engine starts its own workers
            row = call_in_fresh_process(profile, tp, args.steps, args.batch, args.out,
                                        args.smoke, args.quantization, args.chunk, args.shape,
                                        reuse_imports=args.smoke, timeout=400)
        except ChildFailed as exc:
            print(f"TP={tp} failed: {exc}", flush=True)
            continue
        results.append(row)
        print(f"TP={tp} b={args.batch} {label}: {row['wall_ms_per_step']:.3f} ms/step wall, "
              f"{row['kernels_per_step']:.0f} kernels, GPU busy {row['gpu_busy_ms_per_step']:.3f}"
              f" ms, idle {row['gpu_idle_ms_per_step']:.3f} ms, kernel sum "
              f"{row['kernel_ms_per_step']:.3f} ms; allocator during them: "
              f"{row['allocator']}", flush=True)
        for k in row["top"]:
            print(f"   {k['ms_per_step']:7.3f} ms {k['count_per_step']:6.1f}x "
                  f"{k['us_mean']:8.2f} us  {k['name']}", flush=True)
        if row["first_seen"]:
            print(f"   mixed steps of a chunk size run before vs not: {row['first_seen']}",
                  flush=True)
        if row["host_top"]:
            print("   host, own time per step (cProfile):", flush=True)
        for h in row["host_top"]:
            print(f"   {h['ms_per_step']:7.3f} ms {h['calls_per_step']:7.1f}x  {h['where']}",
                  flush=True)
    (args.out / f"step_profile-b{args.batch}-c{args.chunk}-{label}.json").write_text(
        json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
