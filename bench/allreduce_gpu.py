"""Issue 16: the TP all-reduce over torch symmetric memory against NCCL's, on 2 GPUs, and
what it does to tensor-parallel decode.

1. Latency of one all-reduce of a bf16 message of 8 KiB to 4 MiB over 2 ranks (--world): NCCL, and
   the symmetric-memory one-shot and two-shot (the engine takes one-shot at 2 ranks),
   eager (launch + sync each) and replayed from a CUDA graph of 100 back to back; then
   what a decoder layer runs after its row-parallel projection, the message as rows of
   4096: NCCL + the rmsnorm kernel (residual add + RMSNorm), one-shot + the rmsnorm kernel,
   and the fused kernel (kvpilot.kernels.all_reduce_rmsnorm) that the engine runs.
2. Llama-3-8B-shaped dummy model (bf16), each in a fresh process: batch-1 ms/token and
   batch-64 output tok/s at TP=1, TP=2 (symmetric memory, the default) and TP=2 with
   --disable-custom-all-reduce (NCCL). Goals (issue 16): TP=2 batch-1 >= 1.6x faster than
   TP=1; per-GPU batch-64 throughput >= 80% of TP=1's.

    python3 bench/allreduce_gpu.py OUT_DIR            # 2 GPUs (bench/allreduce_gpu_run.sh)
    .venv/bin/python bench/allreduce_gpu.py OUT_DIR --smoke   # CPU, gloo, tiny shapes, one process

Writes results.json and results.md into OUT_DIR after every part; prints the tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from cpu_smoke import one_thread_per_process  # bench/ is this script's sys.path[0]
from parallel_gpu import measure, model_dir, sync

KIB = 1024
SIZES = [8 * KIB << i for i in range(10)]  # 8 KiB .. 4 MiB
SMOKE_SIZES = [8 * KIB, 64 * KIB]
# label -> (TP size, --disable-custom-all-reduce)
CONFIGS = {"tp1": (1, False), "tp2-nccl": (2, True), "tp2-symm-mem": (2, False)}
CONFIG_TIMEOUT_S = 170  # one engine run; a hung one is recorded and the next runs
RESULT_PREFIX = "RESULT "
LOG_FORMAT = "%(name)s: %(message)s"
SAID = "all-reduce: "  # the engine's start-up line that names the all-reduce it chose
HIDDEN, EPS = 4096, 1e-5  # a Llama-3-8B row, for the all-reduce + norm timings


def eager_us(fn: Callable[[torch.Tensor], object], x: torch.Tensor) -> float:
    """Gives the median microseconds of one call, launch to completion."""
    times = []
    for i in range(220):
        sync()
        start = time.perf_counter()
        fn(x)
        sync()
        if i >= 20:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def graph_us(fn: Callable[[torch.Tensor], object], x: torch.Tensor) -> float:
    """Gives the microseconds of one call replayed from a graph of 100 back to back."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(100):
            fn(x)
    graph.replay()
    sync()
    start = time.perf_counter()
    for _ in range(10):
        graph.replay()
    sync()
    elapsed = (time.perf_counter() - start) / 1000 * 1e6
    graph.reset()  # before the groups go (pytorch/pytorch#115388)
    return elapsed


def latency_rank(rank: int, world: int, port: int, device_type: str, sizes: list[int],
                 out: str) -> None:
    """One rank of part 1 (rank 0 writes `out`)."""
    from kvpilot.engine.contracts.rendezvous import Rendezvous
    from kvpilot.engine.parallel import symm_mem_all_reduce
    from kvpilot.engine.parallel.all_reduce_choice import ONE_SHOT, TWO_SHOT
    from kvpilot.engine.parallel.config import ParallelConfig
    from kvpilot.engine.parallel.distributed import destroy_distributed, init_distributed
    from kvpilot.engine.parallel.symm_mem_all_reduce import (
        AllReduceSettings,
        TorchSymmMem,
        setup_symm_mem,
    )

    logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(name)s: %(message)s")
    # fused slots for the largest message: the kernel is timed at every size, also above
    # the engine's FUSED_MAX_BYTES (which these timings set)
    symm_mem_all_reduce.FUSED_MAX_BYTES = dict.fromkeys((2, 4), max(sizes))
    symm_mem_all_reduce.FUSED_WORLD_SIZES = (world,)  # timed at this world size too
    ctx = init_distributed(ParallelConfig(world), Rendezvous.local(world, port), rank,
                           device_type, num_layers=1)
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    tp = setup_symm_mem(ctx.tp, AllReduceSettings(False, max(sizes), dtype), ctx.device,
                        range(world), ctx.min_over_ranks, TorchSymmMem())
    base = replace(tp, symm_mem=None)
    ways: dict[str, Callable[[torch.Tensor], object]] = {
        "nccl" if device_type == "cuda" else "gloo": base.all_reduce}
    if (symm := tp.symm_mem) is not None:
        ways[ONE_SHOT] = lambda x: symm.all_reduce(x, ONE_SHOT)
        ways[TWO_SHOT] = lambda x: symm.all_reduce(x, TWO_SHOT)
    if symm is not None and symm.fused:  # CUDA: the smoke run's gloo has no symmetric memory
        from kvpilot.kernels.rmsnorm import rms_norm

        weight = torch.ones(HIDDEN, dtype=dtype, device=ctx.device)
        residual = torch.zeros(max(sizes) // dtype.itemsize // HIDDEN, HIDDEN, dtype=dtype,
                               device=ctx.device)

        def then_norm(reduce: Callable[[torch.Tensor], torch.Tensor]
                      ) -> Callable[[torch.Tensor], object]:
            def run(x: torch.Tensor) -> object:
                rows = x.view(-1, HIDDEN)
                return rms_norm(reduce(rows), weight, EPS, residual[:len(rows)])
            return run

        ways["nccl+norm"] = then_norm(base.all_reduce)
        ways["one-shot+norm"] = then_norm(lambda rows: symm.all_reduce(rows, ONE_SHOT))
        ways["fused"] = lambda x: symm.ops.add_rms_norm(
            x.view(-1, HIDDEN), residual[:x.numel() // HIDDEN], weight, EPS)
    rows = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // dtype.itemsize, dtype=dtype, device=ctx.device)
        row: dict = {"bytes": nbytes}
        for name, fn in ways.items():
            row[f"{name}_eager_us"] = eager_us(fn, x)
            if device_type == "cuda":
                row[f"{name}_graph_us"] = graph_us(fn, x)
        rows.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps({"world": world, "dtype": str(dtype),
                                         "ways": list(ways), "rows": rows}))
    destroy_distributed()


def measure_latency(world: int, device_type: str, sizes: list[int]) -> dict:
    """Gives part 1's table from `world` fresh processes."""
    from kvpilot.engine.executor.processes import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as root:
        out = str(Path(root) / "latency.json")
        spawn = multiprocessing.get_context("spawn")
        procs = [spawn.Process(target=latency_rank,
                               args=(r, world, port, device_type, sizes, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        for p in procs:  # measured: a rank stuck leaving its groups does not matter
            if p.is_alive():
                p.kill()
        if not Path(out).exists():
            raise RuntimeError(f"latency run failed: exit codes {[p.exitcode for p in procs]}")
        return json.loads(Path(out).read_text())


def run_config(label: str, smoke: bool) -> dict:
    """Gives one engine configuration's numbers; runs in its own process."""
    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine
    from kvpilot.engine.executor.multi_rank_executor import MultiRankExecutor

    tp, disable = CONFIGS[label]
    shape = "tiny" if smoke else "8b"
    batch, prompt_len, new_tokens = (4, 16, 8) if smoke else (64, 128, 256)
    with tempfile.TemporaryDirectory() as root:
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=str(model_dir(Path(root), shape)), load_format="dummy",
            device="cpu" if smoke else "cuda", dtype="float32" if smoke else "bfloat16",
            tensor_parallel_size=tp, max_model_len=1024, max_num_seqs=batch,
            gpu_memory_utilization=0.85, kv_cache_memory="64MiB" if smoke else None,
            disable_custom_all_reduce=disable))
        try:
            runner = engine.runner
            path = "none" if not isinstance(runner, MultiRankExecutor) else \
                "symm-mem" if runner.ctx.tp.symm_mem is not None else \
                "gloo" if smoke else "nccl"
            b1_ms, tok_s, _ = measure(engine, shape, batch, prompt_len, new_tokens)
            stats = engine.get_stats()
        finally:
            engine.shutdown()
    return {"label": label, "tp": tp, "all_reduce": path, "batch": batch,
            "batch1_ms_per_token": b1_ms, "batch_tok_per_s": tok_s,
            "per_gpu_tok_per_s": tok_s / tp, "graph_steps": stats.graph_steps}


def in_fresh_process(label: str) -> dict:
    """Gives run_config's GPU numbers and all-reduce lines from a fresh interpreter
    (GPUs 0..tp-1)."""
    argv = [sys.executable, __file__, "--run-config", label]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CONFIG_TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{label} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    said = [line for line in done.stderr.splitlines() if SAID in line]
    return {**json.loads(lines[-1].removeprefix(RESULT_PREFIX)), "all_reduce_log": said}


class SaidLines(logging.Handler):
    """Keeps this process's log lines that name the all-reduce the engine chose."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if SAID in (line := self.format(record)):
            self.lines.append(line)


def in_this_process(label: str) -> dict:
    """Gives run_config's smoke numbers and all-reduce lines from this process."""
    said = SaidLines()
    root = logging.getLogger()
    root.addHandler(said)
    try:
        return {**run_config(label, smoke=True), "all_reduce_log": said.lines}
    finally:
        root.removeHandler(said)


def config_numbers(label: str, smoke: bool) -> dict:
    """Gives one configuration's numbers: on GPUs from a fresh interpreter, which hands all
    its GPU memory back on exit; in a smoke run from this process, as a fresh interpreter's
    start-up is most of a tiny CPU configuration's time."""
    numbers = in_this_process(label) if smoke else in_fresh_process(label)
    print("\n".join(f"{label}: {line}" for line in numbers["all_reduce_log"]), flush=True)
    return numbers


def markdown(report: dict) -> str:
    out = [f"# TP all-reduce: symmetric memory vs NCCL ({report['machine']}, {report['date']})",
           "", f"Command: `{report['command']}` (torch {report['torch']})", ""]
    if (lat := report.get("latency")) is not None:
        ways = lat["ways"]
        out += [f"One all-reduce, {lat['world']} ranks, {lat['dtype']}, median us "
                "(eager: launch to sync; graph: one of 100 replayed back to back):", "",
                "| message | " + " | ".join(f"{w} eager | {w} graph" for w in ways) + " |",
                "|---|" + "---|---|" * len(ways)]
        for row in lat["rows"]:
            cells = [f"{row.get(f'{w}_eager_us', 0):.1f} | "
                     + (f"{row[f'{w}_graph_us']:.1f}" if f"{w}_graph_us" in row else "-")
                     for w in ways]
            out.append(f"| {row['bytes'] // KIB} KiB | " + " | ".join(cells) + " |")
        out.append("")
    configs = report["configs"]
    if configs:
        base = next((c for c in configs if c["tp"] == 1), None)
        out += ["| config | TP | all-reduce | batch-1 ms/token | speed-up vs TP=1 | "
                "batch tok/s | per GPU | per GPU vs TP=1 | graph steps |",
                "|---|---|---|---|---|---|---|---|---|"]
        for c in configs:
            speed = f"{base['batch1_ms_per_token'] / c['batch1_ms_per_token']:.2f}x" \
                if base else "-"
            per = f"{c['per_gpu_tok_per_s'] / base['per_gpu_tok_per_s']:.0%}" if base else "-"
            out.append(f"| {c['label']} | {c['tp']} | {c['all_reduce']} | "
                       f"{c['batch1_ms_per_token']:.2f} | {speed} | {c['batch_tok_per_s']:.0f} "
                       f"(batch {c['batch']}) | {c['per_gpu_tok_per_s']:.0f} | {per} | "
                       f"{c['graph_steps']} |")
        out += ["", "Goals (issue 16): TP=2 batch-1 >= 1.6x TP=1; per-GPU batch-64 >= 80% of TP=1."]
    for error in report["errors"]:
        out += ["", f"FAILED {error.splitlines()[0]}" if error else "FAILED", "```",
                error[-1500:], "```"]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, nargs="?", help="where results.json/.md go")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, gloo")
    parser.add_argument("--skip-latency", action="store_true", help="only the engine runs")
    parser.add_argument("--world", type=int, default=2, help="ranks of the latency part")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"engine runs, of {', '.join(CONFIGS)}")
    parser.add_argument("--run-config", help=argparse.SUPPRESS)  # LABEL, in a child
    args = parser.parse_args()
    if args.smoke:
        one_thread_per_process()
    if args.run_config or args.smoke:  # where the engines run: their start-up lines show
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    if args.run_config:  # on stderr, read by the parent
        print(RESULT_PREFIX + json.dumps(run_config(args.run_config, args.smoke)), flush=True)
        return 0
    if args.out_dir is None:
        parser.error("out_dir is required")
    labels = [label for label in args.configs.split(",") if label]
    unknown = [label for label in labels if label not in CONFIGS]
    if unknown:
        parser.error(f"--configs {','.join(unknown)}: choose from {', '.join(CONFIGS)}")
    device_type = "cpu" if args.smoke else "cuda"
    report: dict = {
        "machine": "CPU smoke run" if args.smoke else
        f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}",
        "date": datetime.date.today().isoformat(), "host": platform.node(),
        "torch": torch.__version__, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "latency": None, "configs": [], "errors": [],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def write() -> str:  # after every part, so a run cut short keeps what finished
        (args.out_dir / "results.json").write_text(json.dumps(report, indent=2))
        text = markdown(report)
        (args.out_dir / "results.md").write_text(text)
        return text

    failed = False
    if not args.skip_latency:
        try:
            report["latency"] = measure_latency(args.world, device_type,
                                                SMOKE_SIZES if args.smoke else SIZES)
        except RuntimeError as exc:  # recorded; the engine runs still say something
            report["errors"].append(f"latency: {exc}")
            failed = True
        print(write(), flush=True)
    for label in labels:
        try:
            report["configs"].append(config_numbers(label, args.smoke))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            report["errors"].append(f"{label}: {str(exc)[-2000:]}")
            failed = True
        write()
        print(f"done: {label}", flush=True)
    print(write())
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
