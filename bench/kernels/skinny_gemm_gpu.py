"""Does a Triton GEMM read a 16-bit weight faster than cuBLAS at decode batch sizes?

At batch 64 a Llama-3-8B projection is bound by reading its weight, and cuBLAS's pick is
uneven across shards: a batch-64 TP=2 profile (bench/tp_profile_gpu.py) had the o_proj
shard [4096, 2048] at 12.1 us, 1.4 TB/s, against 2.3-2.8 TB/s for the other projections.
For each projection of the TP=1, 2 and 4 shards and each row count, this times F.linear
(cuBLAS) against `w8a16_gemm`'s tiled kernel without scales, autotuned over CONFIGS, both
as CUDA graphs that cycle through enough weight copies that none stays in L2. Prints us,
TB/s and the tiles the autotuner picked.

    python3 bench/kernels/skinny_gemm_gpu.py [--rows 16,32,64] [--tp 1,2,4]   # one GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from w8a16_gemv_gpu import graph_time_us

from kvpilot.kernels import w8a16_gemm as gemm
from kvpilot.kernels.pdl import pdl_args

# (BLOCK_N, BLOCK_K, num_warps, num_stages); configs over shared memory are skipped
CONFIGS = [
    (16, 128, 4, 4), (16, 128, 4, 6), (16, 256, 4, 3), (16, 256, 4, 4), (16, 512, 4, 2),
    (32, 128, 4, 4), (32, 128, 4, 6), (32, 256, 4, 3), (32, 256, 4, 4), (32, 64, 4, 8),
    (64, 64, 4, 6), (64, 128, 4, 4), (64, 128, 8, 4), (128, 64, 8, 4), (128, 128, 8, 3),
    (16, 128, 2, 6), (32, 128, 8, 5),
]
LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
SHARDED_K = {"o", "down"}  # row-parallel: the shard splits K, else N
CALLS = 32


def shard(layer: str, tp: int) -> tuple[int, int]:
    n, k = LAYERS[layer]
    return (n, k // tp) if layer in SHARDED_K else (n // tp, k)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="16,32,64")
    parser.add_argument("--tp", default="1,2,4")
    args = parser.parse_args()
    tuned = gemm._tuned(gemm._w8a16_kernel, CONFIGS, ["N", "K", "BLOCK_M"])
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; median us a call in a graph of {CALLS}")
    print("| TP | layer | N x K | rows | cuBLAS us | TB/s | Triton us | TB/s | Triton/cuBLAS | tiles |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tp in (int(t) for t in args.tp.split(",")):
        for layer in LAYERS:
            n, k = shard(layer, tp)
            nbytes = n * k * 2
            copies = max(2, -(-(256 << 20) // nbytes))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                outs = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                block_m = max(16, triton.next_power_of_2(rows))

                def triton_call(i: int, x=x, n=n, k=k, rows=rows, outs=outs, block_m=block_m, ws=ws,
                                copies=copies):
                    w, out = ws[i % copies], outs[i % 2]
                    tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
                        x, w, w, out, rows, n, k, x.stride(0), w.stride(0), out.stride(0),
                        w, w, 0, 1, BLOCK_M=block_m, HAS_SCALE=False, **gemm.NO_SEND,
                        **pdl_args(x))

                triton_call(0)
                torch.testing.assert_close(outs[0].float(), F.linear(x, ws[0]).float(),
                                           rtol=2e-2, atol=2e-2)
                cfg = tuned.best_config  # pyright: ignore[reportAttributeAccessIssue]
                t_cublas = graph_time_us(lambda i, x=x, ws=ws, copies=copies: F.linear(x, ws[i % copies]),
                                         CALLS)
                t_triton = graph_time_us(triton_call, CALLS)
                tiles = (f"{cfg.kwargs['BLOCK_N']}x{cfg.kwargs['BLOCK_K']} w{cfg.num_warps} "
                         f"s{cfg.num_stages}")
                print(f"| {tp} | {layer} | {n} x {k} | {rows} | {t_cublas:.1f} | "
                      f"{nbytes / t_cublas / 1e6:.2f} | {t_triton:.1f} | "
                      f"{nbytes / t_triton / 1e6:.2f} | {t_triton / t_cublas:.2f} | {tiles} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
