"""TP=1 decode with a 16-bit projection of 2-64 rows on kvpilot's tiled GEMM or on cuBLAS.

The engine runs those projections on the tiled Triton kernel (`w8a16_gemm.decode_linear`;
at 2 ranks the row-parallel ones also send their product into the fused all-reduce,
decision 0066); KVPILOT_TILED_GEMM=0 keeps cuBLAS. This runs bench/parallel_gpu.py's TP=1
measurement (Llama-3-8B shape: batch-1 ms/token, batch-64 tok/s) both ways, alternating, each
in a fresh process, and prints the pairs. The first run of this script (results in
bench/results/parallel-H100-2026-11-27-few-row-send/) patched the same routing in by hand,
before it was the engine's default.

    python3 bench/tiled_tp1_gpu.py [--repeats 2]     # one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

RESULT = "RESULT "


def child() -> None:
    from parallel_gpu import run_config

    print(RESULT + json.dumps(run_config("8b", 1, False)), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child()
        return 0
    print("| run | projections of 2-64 rows | batch-1 ms/token | batch-64 tok/s |")
    print("|---|---|---|---|")
    for repeat in range(args.repeats):
        for mode in ("cublas", "tiled"):
            env = dict(os.environ, KVPILOT_TILED_GEMM="0" if mode == "cublas" else "1")
            done = subprocess.run([sys.executable, __file__, "--child"], env=env,
                                  capture_output=True, text=True, timeout=900)
            lines = [x for x in done.stdout.splitlines() if x.startswith(RESULT)]
            if done.returncode != 0 or not lines:
                print(f"{mode} failed:\n{done.stderr[-3000:]}")
                return 1
            r = json.loads(lines[-1].removeprefix(RESULT))
            print(f"| {repeat + 1} | {mode} | {r['batch1_ms_per_token']:.2f} | "
                  f"{r['batch64_output_tok_per_s']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
