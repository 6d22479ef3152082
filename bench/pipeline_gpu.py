"""Issue 16 part B: pipeline parallelism on GPUs: what the stages cost at batch 1 and what
overlapping batches buys at batch 64.

Llama-3-8B-shaped dummy model (bf16), every configuration in a fresh process: TP=1 with
CUDA graphs (today's best single GPU), TP=1 eager (pipeline stages run eagerly, so this
is the like-for-like baseline), PP=2, and (on 4 GPUs) PP=4 and TP=2 x PP=2. For each:
batch-1 ms/token, batch-64 output tokens/s, per-GPU throughput against TP=1 eager, and
the most batches the engine had in the pipeline at once (overlap needs >= 2).

    .venv/bin/python bench/pipeline_gpu.py bench/results/pipeline_gpu-4xH100 [--configs ...]
    .venv/bin/python bench/pipeline_gpu.py /tmp/out --smoke   # CPU, tiny shapes, gloo, one process

Writes results.json and results.md into the directory; prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # bench/ is no package: import its sibling
from cpu_smoke import one_thread_per_process
from parallel_gpu import measure, model_dir

RESULT_PREFIX = "RESULT "
# label -> (TP, PP, enforce eager)
CONFIGS = {"tp1-graphs": (1, 1, False), "tp1-eager": (1, 1, True), "pp2": (1, 2, True),
           "pp4": (1, 4, True), "tp2-pp2": (2, 2, True)}
SMOKE_CONFIGS = ["tp1-eager", "pp2"]


def run_config(label: str, smoke: bool) -> dict:
    """Gives one configuration's numbers; runs in its own process."""
    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

    tp, pp, eager = CONFIGS[label]
    shape = "tiny" if smoke else "8b"
    device = "cpu" if smoke else "cuda"
    batch, prompt_len, new_tokens = (4, 16, 8) if smoke else (64, 128, 256)
    with tempfile.TemporaryDirectory() as root:
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=str(model_dir(Path(root), shape)), load_format="dummy", device=device,
            dtype="float32" if smoke else "bfloat16", tensor_parallel_size=tp,
            pipeline_parallel_size=pp, enforce_eager=eager, max_model_len=1024,
            max_num_seqs=batch, gpu_memory_utilization=0.85,
            kv_cache_memory="64MiB" if smoke else None))
        try:
            b1_ms, tok_s, _ = measure(engine, shape, batch, prompt_len, new_tokens)
            stats = engine.get_stats()
            in_flight = getattr(engine.runner, "max_in_flight", 1)
        finally:
            engine.shutdown()
    return {"label": label, "tp": tp, "pp": pp, "gpus": tp * pp, "device": device,
            "batch": batch, "batch1_ms_per_token": b1_ms, "batch_output_tok_per_s": tok_s,
            "per_gpu_tok_per_s": tok_s / (tp * pp), "max_batches_in_flight": in_flight,
            "graph_steps": stats.graph_steps, "kv_blocks_per_rank": stats.num_total_blocks}


def in_fresh_process(label: str) -> dict:
    """Gives run_config's GPU numbers from a fresh interpreter."""
    argv = [sys.executable, __file__, "--run-config", label]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{label} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix(RESULT_PREFIX))


def config_numbers(label: str, smoke: bool) -> dict:
    """Gives one configuration's numbers: on GPUs from a fresh interpreter, which hands all
    its GPU memory back on exit; in a smoke run from this process, as a fresh interpreter's
    start-up is most of a tiny CPU configuration's time."""
    return run_config(label, smoke) if smoke else in_fresh_process(label)


def markdown(report: dict) -> str:
    out = [f"# Pipeline parallelism ({report['machine']}, {report['date']})", "",
           f"Command: `{report['command']}`", "",
           "| run | TP | PP | batch-1 ms/token | batch tok/s | per GPU | per GPU vs TP=1 eager "
           "| max batches in flight | graph steps |", "|---|---|---|---|---|---|---|---|---|"]
    base = next((r for r in report["configs"] if r["label"] == "tp1-eager"), None)
    for r in report["configs"]:
        per = f"{r['per_gpu_tok_per_s'] / base['per_gpu_tok_per_s']:.0%}" if base else "-"
        out.append(f"| {r['label']} | {r['tp']} | {r['pp']} | {r['batch1_ms_per_token']:.2f} "
                   f"| {r['batch_output_tok_per_s']:.0f} | {r['per_gpu_tok_per_s']:.0f} | {per} "
                   f"| {r['max_batches_in_flight']} | {r['graph_steps']} |")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, nargs="?", help="where results.json/.md go")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, gloo")
    parser.add_argument("--run-config", help=argparse.SUPPRESS)  # a label, in a child
    args = parser.parse_args()
    if args.smoke:
        one_thread_per_process()
    if args.run_config:
        print(RESULT_PREFIX + json.dumps(run_config(args.run_config, args.smoke)), flush=True)
        return 0
    if args.out_dir is None:
        parser.error("out_dir is required")
    labels = SMOKE_CONFIGS if args.smoke else args.configs.split(",")
    unknown = [label for label in labels if label not in CONFIGS]
    if unknown:
        parser.error(f"--configs has {unknown}: choose from {', '.join(CONFIGS)}")
    gpus = 0 if args.smoke else torch.cuda.device_count()
    report = {
        "machine": "CPU smoke run" if args.smoke else
        f"{gpus}x {torch.cuda.get_device_name(0)}",
        "date": datetime.date.today().isoformat(), "host": platform.node(),
        "torch": torch.__version__, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "configs": [], "skipped": [],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for label in labels:
        tp, pp, _ = CONFIGS[label]
        if not args.smoke and tp * pp > gpus:
            report["skipped"].append(f"{label}: needs {tp * pp} GPUs, {gpus} visible")
            continue
        report["configs"].append(config_numbers(label, args.smoke))
        # after every run, so a run cut short keeps what finished
        (args.out_dir / "results.json").write_text(json.dumps(report, indent=2))
        (args.out_dir / "results.md").write_text(markdown(report))
        print(f"done: {label}", flush=True)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
