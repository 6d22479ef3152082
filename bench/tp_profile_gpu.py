"""Where a decode step's time goes at each TP size (issue 16's 1.6x and 80% lines).

For each TP size, in a fresh process: a Llama-3-8B-shaped dummy model (bf16) decodes --batch
greedy sequences (128-token prompts) for 64 steps; a second run, after a warm-up, runs under
torch.profiler (CUDA kernels of rank 0, the driver's GPU, graph replays included). Reports per
step (the batch's prefill included, spread over the steps): the wall clock, rank 0's GPU busy
time, and the GPU time per kernel family and of the top kernels. A TP=2 step that costs more
than half a TP=1 step shows which kernels do not shrink with the shard. The wall clock runs
under the profiler, whose own cost inflates it: time steps with bench/parallel_gpu.py.

    python3 bench/tp_profile_gpu.py OUT [--tp 1,2] [--batch 64]
    .venv/bin/python bench/tp_profile_gpu.py /tmp/out --smoke   # CPU, a tiny model, gloo
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from parallel_gpu import model_dir, prompts, sync
from recipe_profile_gpu import FAMILIES, family
from step_profile_gpu import busy_ms

TP_FAMILIES = (("all-reduce", ("allreduce", "all_reduce", "one_shot", "two_shot", "nccl")),
               *FAMILIES)
RESULT_PREFIX = "RESULT "
TOKENS = 64


def profile_tp(tp: int, batch: int, smoke: bool) -> dict:
    """Gives one TP size's per-step numbers (runs in its own process)."""
    from torch.profiler import ProfilerActivity, profile

    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.entrypoints.llm import LLM

    shape = "tiny" if smoke else "8b"
    cuda = not smoke
    with tempfile.TemporaryDirectory() as root:
        llm = LLM(str(model_dir(Path(root), shape)), load_format="dummy",
                  tensor_parallel_size=tp, max_model_len=1024, max_num_seqs=64,
                  **({"device": "cpu", "dtype": "float32", "kv_cache_memory": "64MiB"}
                     if smoke else {"gpu_memory_utilization": 0.85}))
        try:
            vocab = llm.engine.model_config.vocab_size
            batch_prompts = prompts(batch, 128, vocab, 1)
            tokens = 8 if smoke else TOKENS
            greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=tokens)
            llm.generate(batch_prompts, greedy)  # warm-up
            prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
            sync()
            start = time.perf_counter()
            with prof:
                llm.generate(batch_prompts, greedy)
                sync()
            wall_ms = (time.perf_counter() - start) * 1e3
        finally:
            llm.engine.shutdown()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind]
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        per_name[e.name].append(e.time_range.end - e.time_range.start)
    families: dict[str, float] = defaultdict(float)
    for name, times in per_name.items():
        families[family(name, TP_FAMILIES)] += sum(times) / tokens
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:20]
    busy = busy_ms([(e.time_range.start, e.time_range.end) for e in events])
    return {"tp": tp, "batch": batch, "tokens": tokens,
            "wall_ms_per_step": round(wall_ms / tokens, 3),
            "gpu_busy_ms_per_step": round(busy / tokens, 3),
            "kernels_per_step": round(len(events) / tokens, 1),
            "families_us_per_step": {k: round(v, 1) for k, v in
                                     sorted(families.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:90], "per_step": round(len(t) / tokens, 2),
                     "us_mean": round(sum(t) / len(t), 2),
                     "us_per_step": round(sum(t) / tokens, 1)} for n, t in top]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)  # one TP size, in a child
    args = parser.parse_args()
    if args.run is not None:
        print(RESULT_PREFIX + json.dumps(profile_tp(args.run, args.batch, args.smoke)),
              flush=True)
        return 0
    if args.out is None:
        parser.error("out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for tp in (int(t) for t in args.tp.split(",")):
        argv = [sys.executable, __file__, "--run", str(tp), "--batch", str(args.batch)] \
            + (["--smoke"] if args.smoke else [])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        lines = [x for x in done.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
        if done.returncode != 0 or not lines:
            print(f"tp={tp} failed ({done.returncode}):\n{done.stderr[-3000:]}", flush=True)
            continue
        results.append(json.loads(lines[-1].removeprefix(RESULT_PREFIX)))
        print(json.dumps(results[-1], indent=1), flush=True)
    (args.out / f"tp_profile-b{args.batch}.json").write_text(json.dumps(results, indent=1))
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
