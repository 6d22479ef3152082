"""Builds, uses and releases parallel `LLM`s one after the other in one process, and checks that
each left nothing behind: no worker process, no process group, no thread, and on CUDA no
device memory; file descriptors do not grow after the first engine (torch keeps one pipe pair
of its own once a process has joined a gloo group). The engines are released in turn by
leaving `with`, by dropping the last reference and by `shutdown()`, and all give the same
greedy tokens. Run by tests/parallel/test_lifecycles.py (CPU with gloo; two GPUs with NCCL
when they are there), or by hand:

    python tests/parallel/two_engines.py --engines tp2,tp2,pp2 [--device cuda]

Prints one JSON line per engine (its tokens and what it left) and exits 1 when one leaked.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
from typing import Any

import psutil
import torch
import torch.distributed as dist

from kvpilot.engine.entrypoints.llm import LLM, SamplingParams

PROMPTS = ["The capital of France is", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
RELEASES = ("with", "del", "shutdown")


def snapshot(device: str) -> dict[str, Any]:
    """Gives what this process holds now that an engine could leak."""
    me = psutil.Process()
    return {"children": sorted(p.pid for p in me.children(recursive=True)
                               if p.status() != psutil.STATUS_ZOMBIE),
            "threads": sorted(t.name for t in threading.enumerate()),
            "fds": me.num_fds(),
            "process_group": dist.is_initialized(),
            "cuda_allocated": torch.cuda.memory_allocated() if device == "cuda" else 0,
            "cuda_reserved": torch.cuda.memory_reserved() if device == "cuda" else 0}


def leaks(baseline: dict[str, Any], device: str) -> dict[str, tuple[Any, Any]]:
    """Gives {resource: (baseline, now)} for what has not returned to `baseline` right after
    a release (which waits for the workers and joins the threads itself)."""
    gc.collect()
    now = snapshot(device)
    return {k: (baseline[k], now[k]) for k in baseline if now[k] != baseline[k]}


def topology(name: str) -> dict[str, int]:
    """Gives the parallel sizes of 'tp2', 'pp2' or 'tp2pp2'."""
    sizes = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    for part, key in (("tp", "tensor_parallel_size"), ("pp", "pipeline_parallel_size")):
        if part in name:
            digits = name.split(part, 1)[1]
            sizes[key] = int(digits[:next((i for i, c in enumerate(digits)
                                           if not c.isdigit()), len(digits))])
    return sizes


def run(name: str, release: str, device: str, model: str) -> tuple[list[list[int]], int]:
    """Builds engine `name`, generates, releases it the `release` way; gives its tokens and
    how many worker processes it had."""
    llm = LLM(model, device=device, num_kv_blocks=64, max_model_len=256, **topology(name))
    workers = len(snapshot(device)["children"])
    if release == "with":
        with llm:
            outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    else:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        if release == "shutdown":
            llm.shutdown()
    del llm  # for "with" and "shutdown" already released; for "del" this releases it
    return [o.outputs[0].token_ids for o in outputs], workers


def main() -> int:
    parser = argparse.ArgumentParser(description="parallel LLMs one after the other in one process")
    parser.add_argument("--engines", default="tp2,tp2,pp2")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default="tiny-llama")
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.init()  # the CUDA context is the process's, not an engine's
    baseline = snapshot(args.device)
    failed, first_tokens = False, None
    for i, name in enumerate(args.engines.split(",")):
        release = RELEASES[i % len(RELEASES)]
        tokens, workers = run(name, release, args.device, args.model)
        left = leaks(baseline, args.device)
        sizes = topology(name)
        expected_workers = sizes["tensor_parallel_size"] * sizes["pipeline_parallel_size"] - 1
        first_tokens = first_tokens or tokens
        print(json.dumps({"engine": i + 1, "topology": name, "released_by": release,
                          "workers": workers, "tokens": tokens, "left": left}), flush=True)
        failed |= (bool(set(left) - ({"fds"} if i == 0 else set()))
                   or workers != expected_workers or tokens != first_tokens)
        baseline["fds"] = snapshot(args.device)["fds"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
