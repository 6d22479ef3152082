"""Would TP=1 gain from the tiled Triton GEMM where the engine keeps cuBLAS?

At 2 ranks the row-parallel projections of 2-64 rows run on kvpilot's tiled GEMM because it
sends their product into the fused all-reduce (decision 0066); everywhere else a 16-bit
projection of 2-64 rows runs on cuBLAS. On its own the tiled kernel was 3-6% faster than
cuBLAS on two of Llama-3-8B's four projections at 64 rows (bench/kernels/skinny_gemm_gpu.py).
This runs bench/parallel_gpu.py's TP=1 measurement (batch-1 ms/token, batch-64 tok/s) as the
engine is, and with every 16-bit projection of 2-64 rows (not the LM head) on the tiled
kernel, alternating, each in a fresh process, and prints the pairs: how much of the TP=2
per-GPU ratio comes from TP=1 keeping cuBLAS.

    python3 bench/tiled_tp1_gpu.py [--repeats 2]     # one GPU
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

RESULT = "RESULT "
VOCAB_MIN = 65536  # an N this large is the LM head: left on its path


def tiled_everywhere() -> None:
    """Routes every 16-bit CUDA projection of 2-64 rows through `skinny_linear`."""
    import torch

    from kvpilot.kernels import w8a16_gemm as gemm

    plain = gemm.one_row_linear

    def linear(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if (x.is_cuda and x.dim() == 2 and 1 < x.shape[0] <= gemm.MAX_M and bias is None
                and weight.shape[0] < VOCAB_MIN and x.dtype == weight.dtype
                and weight.dtype in (torch.bfloat16, torch.float16)
                and x.stride(1) == 1 and weight.stride(1) == 1):
            return gemm.skinny_linear(x, weight)
        return plain(x, weight, bias)

    gemm.one_row_linear = linear  # the fused-kernel seam imports it when the model loads


def child(tiled: bool) -> None:
    from parallel_gpu import run_config

    if tiled:
        tiled_everywhere()
    print(RESULT + json.dumps(run_config("8b", 1, False)), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", choices=["cublas", "tiled"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child == "tiled")
        return 0
    print("| run | projections of 2-64 rows | batch-1 ms/token | batch-64 tok/s |")
    print("|---|---|---|---|")
    for repeat in range(args.repeats):
        for mode in ("cublas", "tiled"):
            done = subprocess.run([sys.executable, __file__, "--child", mode],
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
