"""Issue 7 a) and b): paged attention against the copy roofline and torch's flash SDPA.

a) decode: bytes the kernel must move (each K/V token read once, q read, out
   written) over its median time, as a fraction of a device-to-device copy's
   bandwidth (bytes read + written) measured in the same run.
b) prefill: causal FLOPs (4 * B * H * N^2 * D / 2) over the median time,
   against `scaled_dot_product_attention` forced onto the flash backend.

Every variant is checked against a reference before it is timed; a small sweep
over tile sizes, warps, stages and split counts keeps the best. Writes
`attention.json` and `attention.md` to the folder given by --out.

    python bench/kernels/attention_bench.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from kvpilot.kernels.paged_decode_attention import (
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kvpilot.kernels.paged_prefill_attention import default_tiles, paged_prefill_attention

BF16 = torch.bfloat16


def median_ms(fn) -> float:
    """Gives the median time of `fn` in ms (events, warm-up first)."""
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Gives device-to-device copy bandwidth in GB/s, counting bytes read plus written."""
    src = torch.randn(num_bytes // 2, dtype=BF16, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / ms / 1e6


def matmul_tflops(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, dtype=BF16, device="cuda") for _ in range(2))
    return 2 * n**3 / median_ms(lambda: a @ b) / 1e9


def decode_case(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int,
                block_size: int, copy_gbps: float) -> dict:
    """Gives the decode sweep's rows and best row for one (batch, ctx) shape."""
    blocks_per_seq = ctx // block_size
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=BF16, device="cuda")
    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, dtype=BF16, device="cuda")
    scale = head_dim**-0.5
    num_bytes = cache.numel() * 2 + 2 * q.numel() * 2 + tables.numel() * 4
    check = 4  # the reference loops per sequence: check a few
    ref = paged_decode_attention_ref(q[:check], cache, tables[:check], seq_lens[:check], scale)
    default = default_num_splits(batch, kv_heads, ctx)
    rows = []
    for block_n, warps, stages, splits in itertools.product(
            (32, 64, 128), (4, 8), (2, 3, 4), sorted({1, default, 2 * default, 4 * default, 8})):
        def run(block_n=block_n, warps=warps, stages=stages, splits=splits):
            return paged_decode_attention(q, cache, tables, seq_lens, scale, splits,
                                          block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            out = run()
            err = rel_err(out[:check], ref)
            ms = median_ms(run) if err < 2e-2 else float("nan")
        except Exception as exc:  # a tile that overflows shared memory is skipped, not fatal
            rows.append({"block_n": block_n, "warps": warps, "stages": stages,
                         "splits": splits, "error": str(exc)[:120]})
            continue
        gbps = num_bytes / ms / 1e6
        rows.append({"block_n": block_n, "warps": warps, "stages": stages, "splits": splits,
                     "rel_err": err, "ms": ms, "gbps": gbps, "of_copy": gbps / copy_gbps})
    timed = [r for r in rows if r.get("ms", float("nan")) == r.get("ms")]
    best = min(timed, key=lambda r: r["ms"])
    launcher = next(r for r in timed if r["block_n"] == 64 and r["warps"] == 4
                    and r["stages"] == 3 and r["splits"] == default)
    return {"batch": batch, "ctx": ctx, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "block_size": block_size, "bytes": num_bytes,
            "default_splits": default, "best": best, "launcher_default": launcher,
            "sweep": rows}


def prefill_case(batch: int, tokens: int, heads: int, head_dim: int) -> dict:
    """Gives the prefill sweep and the flash-SDPA baseline for one causal shape."""
    total = batch * tokens
    q, k, v = (torch.randn(total, heads, head_dim, dtype=BF16, device="cuda") for _ in range(3))
    # no cached prefix: the cache is a placeholder the kernel never reads
    cache = torch.zeros(2, 1, 16, heads, head_dim, dtype=BF16, device="cuda")
    tables = torch.zeros(batch, 1, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, total + 1, tokens, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), tokens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    flops = 4 * batch * heads * tokens * tokens * head_dim / 2

    def as_bhnd(x):
        return x.view(batch, tokens, heads, head_dim).transpose(1, 2)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                as_bhnd(q), as_bhnd(k), as_bhnd(v), is_causal=True, scale=scale)

    ref = sdpa().transpose(1, 2).reshape(total, heads, head_dim)
    sdpa_ms = median_ms(sdpa)
    rows = []
    for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        if bm % bn:
            continue

        def run(bm=bm, bn=bn, warps=warps, stages=stages):
            return paged_prefill_attention(q, k, v, cache, tables, starts, seq_lens, tokens,
                                           scale, block_m=bm, block_n=bn, num_warps=warps,
                                           num_stages=stages)
        try:
            err = rel_err(run(), ref)
            ms = median_ms(run) if err < 2e-2 else float("nan")
        except Exception as exc:
            rows.append({"block_m": bm, "block_n": bn, "warps": warps, "stages": stages,
                         "error": str(exc)[:120]})
            continue
        rows.append({"block_m": bm, "block_n": bn, "warps": warps, "stages": stages,
                     "rel_err_vs_sdpa": err, "ms": ms, "tflops": flops / ms / 1e9,
                     "of_sdpa": sdpa_ms / ms})
    timed = [r for r in rows if r.get("ms", float("nan")) == r.get("ms")]
    best = min(timed, key=lambda r: r["ms"])
    bm, bn, warps, stages = default_tiles(head_dim)
    launcher = next((r for r in timed if (r["block_m"], r["block_n"], r["warps"], r["stages"])
                     == (bm, bn, warps, stages)), None)
    return {"batch": batch, "tokens": tokens, "heads": heads, "head_dim": head_dim,
            "flops": flops, "sdpa_flash_ms": sdpa_ms, "sdpa_flash_tflops": flops / sdpa_ms / 1e9,
            "best": best, "launcher_default": launcher, "sweep": rows}


def markdown(result: dict) -> str:
    """Gives the short table committed next to the JSON."""
    lines = [f"# Paged attention on {result['gpu']} ({result['date']})", "",
             f"torch {result['torch']}, triton {result['triton']}; device-to-device copy "
             f"{result['copy_gbps']:.0f} GB/s (read+write), bf16 matmul "
             f"{result['matmul_tflops']:.0f} TFLOP/s.", "",
             "| benchmark | shape | kvpilot | baseline | ratio | goal | best config |",
             "|---|---|---|---|---|---|---|"]
    for d in result["decode"]:
        b = d["best"]
        lines.append(f"| a) decode | B={d['batch']} ctx={d['ctx']} 32q/8kv d128 bs16 | "
                     f"{b['gbps']:.0f} GB/s ({b['ms']:.3f} ms) | copy {result['copy_gbps']:.0f}"
                     f" GB/s | {b['of_copy']:.2f} | >= 0.85 | block_n={b['block_n']} "
                     f"warps={b['warps']} stages={b['stages']} splits={b['splits']} |")
    for p in result["prefill"]:
        b = p["best"]
        lines.append(f"| b) prefill | B={p['batch']} N={p['tokens']} H={p['heads']} d"
                     f"{p['head_dim']} causal | {b['tflops']:.0f} TFLOP/s ({b['ms']:.2f} ms) | "
                     f"SDPA flash {p['sdpa_flash_tflops']:.0f} TFLOP/s | {b['of_sdpa']:.2f} | "
                     f">= 0.8 | block_m={b['block_m']} block_n={b['block_n']} "
                     f"warps={b['warps']} stages={b['stages']} |")
    lines += ["", "Launcher defaults (what the engine runs without tuning):", ""]
    for d in result["decode"]:
        r = d["launcher_default"]
        lines.append(f"- decode B={d['batch']} ctx={d['ctx']}: {r['of_copy']:.2f} of copy "
                     f"(splits={r['splits']})")
    for p in result["prefill"]:
        r = p["launcher_default"]
        if r:
            lines.append(f"- prefill: {r['of_sdpa']:.2f} of SDPA flash")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "triton": triton.__version__,
              "copy_gbps": copy_bandwidth(), "matmul_tflops": matmul_tflops()}
    result["decode"] = [decode_case(b, c, 32, 8, 128, 16, result["copy_gbps"])
                        for b, c in ((64, 4096), (256, 1024))]
    torch.cuda.empty_cache()
    result["prefill"] = [prefill_case(8, 4096, 32, 128)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (out / "attention.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
