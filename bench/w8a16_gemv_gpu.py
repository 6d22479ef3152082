"""One decode row through each projection of the Llama-3-8B shape, on one GPU: what every
way of multiplying it reads per second, side by side in one run.

Per layer shape (q|k|v, o, gate|up, down) and weight format:
- bf16 `F.linear` (cuBLAS, what the bf16 engine runs);
- bf16 through the one-row Triton GEMV (`kvpilot.kernels.w8a16_gemm`, scale 1);
- int8 and fp8 E4M3 through the tiled `tl.dot` kernel (rows padded to 16) and through the
  one-row GEMV, both autotuned as in the engine.
Each timing is a CUDA graph of 50 back-to-back calls cycling through enough copies of the
weight (>= 256 MB) that L2 holds none of them; GB/s counts the weight's bytes. The roofline
is a device-to-device copy of 1 GiB (bytes read + written per second). The layer total
(all four shapes, 32 layers) is the projections' share of a batch-1 decode step.

    python bench/w8a16_gemv_gpu.py OUT_DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
LAYERS = 32
CALLS = 50


def graph_time_us(fn, calls: int = CALLS, repeats: int = 7) -> float:
    """Median µs per call of `fn(i)` for i in range(calls), captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us(lambda i: dst.copy_(src), calls=10)
    return 2 * src.numel() / us / 1e3


FORMATS = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def measure(name: str, n: int, k: int, fmt: str, roof: float) -> list[dict]:
    """Times one row through an [n, k] weight of `fmt` with each kernel that takes it."""
    import kvpilot.kernels.w8a16_gemm as gemm

    dtype = FORMATS[fmt]
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    scale = (torch.rand(n, device="cuda") * 0.01 + 1e-4) if fmt != "bf16" else \
        torch.ones(n, device="cuda")
    copies = max(2, (256 << 20) // (n * k * dtype.itemsize) + 1)
    if dtype == torch.int8:
        ws = [torch.randint(-127, 128, (n, k), dtype=dtype, device="cuda") for _ in range(copies)]
    else:
        ws = [torch.randn(n, k, device="cuda").to(dtype) for _ in range(copies)]

    def triton_gemm(i: int) -> torch.Tensor:
        return gemm.w8a16_gemm(x, ws[i % copies], scale)

    variants = {"cublas": lambda i: F.linear(x, ws[i % copies])} if fmt == "bf16" else \
        {"tiled": triton_gemm}
    variants["gemv"] = triton_gemm
    ref = F.linear(x.float(), ws[0].float() * scale[:, None])
    nbytes = n * k * dtype.itemsize
    rows = []
    for variant, fn in variants.items():
        gemm.USE_GEMV = variant == "gemv"
        err = ((fn(0).float() - ref).norm() / ref.norm()).item()
        us = graph_time_us(fn)
        rows.append({"shape": name, "n": n, "k": k, "format": fmt, "kernel": variant,
                     "us": round(us, 2), "gbps": round(nbytes / us / 1e3, 1),
                     "of_copy": round(nbytes / us / 1e3 / roof, 3), "rel_err": round(err, 5)})
        print(rows[-1], flush=True)
    gemm.USE_GEMV = True
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    roof = copy_gbps()
    rows = [row for name, (n, k) in SHAPES.items()
            for fmt in ("bf16", "int8", "fp8") for row in measure(name, n, k, fmt, roof)]
    totals = {}
    for r in rows:
        key = f"{r['format']}/{r['kernel']}"
        totals[key] = totals.get(key, 0.0) + r["us"] * LAYERS / 1000
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
              "copy_gbps": round(roof, 1), "rows": rows,
              "layers_ms": {k: round(v, 3) for k, v in totals.items()}}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"# One decode row through the 8B projections ({result['gpu']}, {result['date']})",
             "", f"Command: `python3 bench/w8a16_gemv_gpu.py OUT`. Copy roofline "
             f"{roof:.0f} GB/s.", "",
             "| shape | N x K | format | kernel | µs | GB/s | of copy | rel err |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['n']}x{r['k']} | {r['format']} | {r['kernel']} | {r['us']} | "
              f"{r['gbps']} | {r['of_copy']} | {r['rel_err']} |" for r in rows]
    lines += ["", "32 layers' projections, ms per batch-1 step:", ""]
    lines += [f"- {k}: {v:.3f}" for k, v in totals.items()]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
