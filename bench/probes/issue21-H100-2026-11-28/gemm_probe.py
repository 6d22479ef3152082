"""Probe: Qwen3-0.6B's decode GEMMs at the recipe's batch sizes, cuBLAS vs Triton tilings.

Per (shape, M): 28 distinct weights (as the 28 layers) launched in one CUDA graph; us per
launch, GB/s (weight + x + out once), TFLOP/s, and the floor max(bytes/copy_bw, flops/peak).
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
MS = [int(m) for m in os.environ.get("MS", "16,32,48,64,96,128,160,192,256").split(",")]
LAYERS = 28


def cfgs():
    out = []
    for bm, bn, bk, w, s in [
        (64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (64, 128, 64, 4, 4), (64, 128, 64, 8, 4),
        (128, 64, 64, 4, 4), (128, 64, 64, 8, 4), (128, 128, 64, 8, 3), (64, 32, 128, 4, 4),
        (32, 64, 128, 4, 4), (64, 64, 64, 4, 6), (128, 32, 64, 4, 4), (64, 256, 64, 8, 3),
        (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
    ]:
        out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w,
                                 num_stages=s))
    return out


@triton.autotune(cfgs(), key=["M", "N", "K"])
@triton.jit
def _mm(x_ptr, w_ptr, o_ptr, M, N, K, sxm, swn, som,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * sxm + (k0 + offs_k)[None, :],
                    mask=(offs_m < M)[:, None], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * swn + (k0 + offs_k)[None, :],
                    mask=(offs_n < N)[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(o_ptr + offs_m[:, None] * som + offs_n[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def tmm(x, w, out):
    M, K = x.shape
    N = w.shape[0]
    _mm[lambda m: (triton.cdiv(N, m["BLOCK_N"]), triton.cdiv(M, m["BLOCK_M"]))](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0))
    return out


def graph_us(fn_layers):
    fn_layers()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn_layers()
    ms = do_bench(g.replay, warmup=20, rep=100, return_mode="median")
    return ms * 1e3 / LAYERS


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() * 2 / do_bench(lambda: dst.copy_(src), return_mode="median") / 1e6
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    peak = 2 * 8192 ** 3 / do_bench(lambda: a @ a, return_mode="median") / 1e9
    print(f"copy {copy_gbps:.0f} GB/s, bf16 GEMM {peak:.0f} TFLOP/s", flush=True)
    del src, dst, a
    rows = []
    sys.path.insert(0, "kernels")
    from kvpilot.kernels.w8a16_gemm import MAX_M, skinny_linear
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
              for _ in range(LAYERS)]
        for m in MS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
            ref = F.linear(x.float(), ws[0].float())
            got = tmm(x, ws[0], outs[0]).float()
            err = ((got - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (name, m, err)
            res = {"shape": name, "N": n, "K": k, "M": m, "triton_err": err}
            res["cublas_us"] = graph_us(lambda: [F.linear(x, w) for w in ws])
            res["triton_us"] = graph_us(lambda: [tmm(x, w, o) for w, o in zip(ws, outs)])
            res["triton_cfg"] = str(_mm.best_config)
            if 1 < m <= MAX_M:
                res["skinny_us"] = graph_us(lambda: [skinny_linear(x, w) for w in ws])
            byts = (n * k + m * k + m * n) * 2
            flops = 2 * m * n * k
            res["floor_us"] = max(byts / copy_gbps / 1e3, flops / peak / 1e6)
            rows.append(res)
            print(json.dumps(res), flush=True)
    # LM head (tied embedding) once per step
    w = torch.randn(151936, 1024, dtype=torch.bfloat16, device="cuda") / 32
    for m in MS:
        x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(m, 151936, dtype=torch.bfloat16, device="cuda")
        res = {"shape": "lm_head", "N": 151936, "K": 1024, "M": m,
               "cublas_us": do_bench(lambda: F.linear(x, w), return_mode="median") * 1e3,
               "triton_us": do_bench(lambda: tmm(x, w, out), return_mode="median") * 1e3,
               "triton_cfg": str(_mm.best_config)}
        res["floor_us"] = max((151936 * 1024 + m * 151936) * 2 / copy_gbps / 1e3,
                              2 * m * 151936 * 1024 / peak / 1e6)
        rows.append(res)
        print(json.dumps(res), flush=True)
    json.dump({"copy_gbps": copy_gbps, "peak_tflops": peak, "rows": rows,
               "device": torch.cuda.get_device_name()}, open(f"{out_dir}/gemm_probe.json", "w"),
              indent=1)
    print("| shape | M | cuBLAS us | triton us | skinny us | floor us | best/cuBLAS |")
    for r in rows:
        best = min(r["triton_us"], r.get("skinny_us", 1e9))
        print(f"| {r['shape']} | {r['M']} | {r['cublas_us']:.2f} | {r['triton_us']:.2f} | "
              f"{r.get('skinny_us', float('nan')):.2f} | {r['floor_us']:.2f} | "
              f"{r['cublas_us'] / best:.2f} |")


if __name__ == "__main__":
    main()
