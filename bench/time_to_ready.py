"""Time to ready of `kvpilot serve` on a cold node (empty compile cache) and a warm one.

Starts the server twice on the same model with TRITON_CACHE_DIR set to one new directory:
first empty (a node that never served: every kernel compiles, as the warm-up does before
ready), then again with what the first run left there (a replica rescheduled on a node that
served before, the operator's --compile-cache-dir). Reported per run: wall seconds from
the process start to /ready answering 200, the engine's own kvpilot_engine_startup_seconds,
the compile cache's size, and the start-up log's CUDA-graph and warm-up lines. Then, on
each started server, lone requests one after another: the first after ready, then
`WARM_REQUESTS` more, each prompt as long but its own (no prefix hit), whose median is the
warm TTFT the first is compared with, and last the first prompt again (a prefix hit, for
scale).

    python bench/time_to_ready.py --out DIR [--shape 0.6b]
    python bench/time_to_ready.py --out DIR --smoke   # tiny CPU run: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from serve_vs_offline import TINY
from serve_vs_offline import _wait_ready as wait_ready

from kvpilot.engine.contracts.args import EngineArgs

STARTUP = re.compile(r"^kvpilot_engine_startup_seconds\{[^}]*\} (\S+)$", re.M)


def cache_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def first_ttft_ms(base: str, prompt: str) -> float:
    """Gives the wall ms of a one-token completion of `prompt` (its TTFT)."""
    started = time.perf_counter()
    reply = httpx.post(f"{base}/v1/completions", timeout=120,
                       json={"model": "served", "prompt": prompt, "max_tokens": 1})
    reply.raise_for_status()
    return (time.perf_counter() - started) * 1e3


WARM_REQUESTS = 5


def prompt_of(k: int, words: int) -> str:
    """Gives the k-th prompt of `words` words: the same words as every other k, shifted, so
    no two share their first block (no prefix hit between them)."""
    return " ".join(f"t{(i + 37 * k) % 500}" for i in range(words))


def start(path: str, flags: dict[str, Any], cache: Path, log: Path, words: int
          ) -> dict[str, Any]:
    """Gives one server start's numbers and its lone requests' TTFTs."""
    args = EngineArgs(model=path, load_format="dummy", **flags).to_cli()
    command = [sys.executable, "-m", "kvpilot.cli", "serve", *args, "--port", "0",
               "--served-model-name", "served"]
    # steps over 30 ms are logged with their phases: where a slow first request spends it
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), KVPILOT_SLOW_STEP_MS="30")
    began = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        base = wait_ready(proc, log)
        ready = time.perf_counter() - began
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        found = STARTUP.search(metrics)
        ttfts = [first_ttft_ms(base, prompt_of(k, words)) for k in range(WARM_REQUESTS + 1)]
        hit = first_ttft_ms(base, prompt_of(0, words))
    finally:
        proc.terminate()
        proc.wait(120)
    lines = [line[:300] for line in log.read_text(errors="replace").splitlines()
             if re.search(r"CUDA graphs|warm-up|compile cache|first use|slow", line)]
    warm = statistics.median(ttfts[1:])
    return {"seconds_to_ready": ready,
            "engine_startup_seconds": float(found.group(1)) if found else None,
            "cache_bytes_after": cache_bytes(cache), "first_ttft_ms": ttfts[0],
            "warm_ttft_ms": ttfts[1:], "warm_ttft_ms_median": warm,
            "first_over_warm": ttfts[0] / warm,
            "prefix_hit_ttft_ms": hit, "log": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="0.6b")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from e2e_gpu import LLAMA3_8B, QWEN3_0_6B, model_dir

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.smoke:
            config, flags = TINY, {"device": "cpu", "max_model_len": 256, "num_kv_blocks": 64}
        else:
            config = {"0.6b": QWEN3_0_6B, "8b": LLAMA3_8B}[args.shape]
            flags = {"max_model_len": 4096, "max_num_batched_tokens": 512}
        path = str(model_dir(root, args.shape, config))
        cache = root / "triton-cache"
        cache.mkdir()
        runs = {name: start(path, flags, cache, root / f"{name}.log",
                            200 if args.smoke else 960)
                for name in ("cold", "warm")}
    result = {"shape": args.shape, "flags": flags, **runs}
    (args.out / "time_to_ready.json").write_text(json.dumps(result, indent=1))
    for name, run in runs.items():
        print(f"{args.shape} {name} cache: ready in {run['seconds_to_ready']:.1f} s "
              f"(engine {run['engine_startup_seconds']}), cache {run['cache_bytes_after']} B, "
              f"first request TTFT {run['first_ttft_ms']:.1f} ms, warm median "
              f"{run['warm_ttft_ms_median']:.1f} ms (first / warm {run['first_over_warm']:.2f}; "
              f"warm {[round(t, 1) for t in run['warm_ttft_ms']]}), first prompt again "
              f"(prefix hit) {run['prefix_hit_ttft_ms']:.1f} ms")
        for line in run["log"]:
            print("   ", line)


if __name__ == "__main__":
    main()
