"""Issues 7 and 21: paged attention against the copy roofline and torch's fastest SDPA.

a) decode: bytes the kernel must move (each K/V token read once, q read, out
   written) over its median time, as a fraction of a device-to-device copy's
   bandwidth (bytes read + written) measured in the same run.
b) prefill: causal FLOPs (4 * B * H * N^2 * D / 2) over the median time, at
   issue 21's shapes (B=8 N=4096 H=32 d128 MHA and 32/8 GQA, B=16 N=2048 GQA),
   against `scaled_dot_product_attention` on every backend torch runs here
   (cuDNN, flash, memory-efficient; torch's own pick too), each timed on the
   same tensors: the baseline is the fastest, named in the table with every
   backend's TFLOP/s. GQA goes through `enable_gqa=True` where a backend takes
   it, else K/V repeated to every head before timing (the repeat is not timed).

Every variant is checked against a reference before it is timed; a small sweep
over tile sizes, warps, stages and split counts (for the Gluon prefill kernel: query
buffers, K/V stages, L2 group size) keeps the best. Writes
`attention.json` and `attention.md` to the folder given by --out.

    python bench/kernels/attention_bench.py --out bench/results
    TRITON_INTERPRET=1 python bench/kernels/attention_bench.py --out DIR --smoke   # CPU, tiny
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import cast

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from kvpilot.kernels.paged_decode_attention import (
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kvpilot.kernels.paged_prefill_attention import (
    TMA_BY_DEFAULT,
    default_tiles,
    no_prefix_kernel_ok,
    paged_prefill_attention,
)
from kvpilot.kernels.prefill_attention_gluon import (
    L2_BYTES,
    Q_BUFFERS,
    STAGES,
    gluon_prefill_attention,
)

BF16 = torch.bfloat16
# torch's SDPA backends that can be fastest on a GPU (the math one materialises N x N)
SDPA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
# (batch, tokens, heads, kv heads): issue 21's prefill shapes, d = 128
PREFILL_SHAPES = ((8, 4096, 32, 32), (8, 4096, 32, 8), (16, 2048, 32, 8))


def median_ms(fn) -> float:
    """Gives the median time of `fn` in ms (CUDA events, warm-up first; wall clock on CPU)."""
    if not torch.cuda.is_available():
        fn()
        times = []
        for _ in range(3):
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times)
    return cast(float, do_bench(fn, warmup=25, rep=200, return_mode="median"))


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


def sdpa_baselines(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   flops: float) -> tuple[list[dict], torch.Tensor]:
    """Times causal SDPA on [B, H, N, D] q (and [B, KVH, N, D] k, v) on each backend in
    `SDPA_BACKENDS` and on torch's own pick ("default"); gives a row per backend (ms and
    TFLOP/s, or why it did not run) and the first output, for checking."""
    gqa = k.shape[1] != q.shape[1]
    repeated = (k.repeat_interleave(q.shape[1] // k.shape[1], dim=1),
                v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)) if gqa else (k, v)
    rows, ref = [], None
    for name in ("default", *SDPA_BACKENDS):
        backend = getattr(SDPBackend, name, None)
        if name != "default" and backend is None:
            rows.append({"backend": name, "error": "not in this torch"})
            continue
        errors = []
        for how, (kk, vv), extra in (("enable_gqa", (k, v), {"enable_gqa": True}),
                                     ("repeated K/V", repeated, {})) if gqa else \
                (("-", (k, v), {}),):
            def run(kk=kk, vv=vv, extra=extra, backend=backend):
                if backend is None:
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, kk, vv, is_causal=True, scale=scale, **extra)
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, kk, vv, is_causal=True, scale=scale, **extra)
            try:
                out = run()
            except RuntimeError as exc:  # this backend does not take these inputs here
                errors.append(f"{how}: {str(exc).splitlines()[0][:100]}")
                continue
            if ref is None:
                ref = out
            err = rel_err(out, ref)
            ms = median_ms(run)
            rows.append({"backend": name, "gqa": how, "ms": ms, "tflops": flops / ms / 1e9,
                         "rel_err_vs_first": err})
            break
        else:
            rows.append({"backend": name, "error": "; ".join(errors)})
    if ref is None:
        raise RuntimeError(f"no SDPA backend ran: {rows}")
    return rows, ref


# the prefill kernels: the pointer kernel, the TMA kernel (Hopper on) and the Gluon kernel
# (Hopper, no cached prefix), each with the configurations its sweep tries: tiles (block_m,
# block_n, warps, stages) for the Triton kernels, (query buffers, K/V stages, MiB of K/V per
# L2 group) for the Gluon one
PREFILL_KERNELS = ("pointer", "tma", "gluon")
SWEEP = {"pointer": list(itertools.product((128,), (32, 64), (4, 8), (3, 4))),
         "tma": list(itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4))),
         "gluon": [(1, 3, 10), (2, 2, 10), (1, 3, 16), (1, 3, 24)]}


def gluon_runs_here() -> bool:
    """Whether the launcher takes the Gluon kernel on this device (its own test, on a bf16
    d128 probe with no cached prefix)."""
    if not torch.cuda.is_available():
        return False
    x = torch.empty(1, 1, 128, dtype=BF16, device="cuda")
    return no_prefix_kernel_ok(x, x, x)


def default_kernel() -> str:
    """The kernel the launcher takes for a batch with no cached prefix."""
    return "gluon" if gluon_runs_here() else "tma" if TMA_BY_DEFAULT else "pointer"


def config(kernel: str, values: tuple[int, ...]) -> dict:
    """A sweep row's configuration, named."""
    keys = ("q_buffers", "stages", "l2_mib") if kernel == "gluon" else (
        "block_m", "block_n", "warps", "stages")
    return {"kernel": kernel} | dict(zip(keys, values, strict=True))


def default_config(kernel: str, head_dim: int) -> dict:
    """The configuration the launcher runs `kernel` with."""
    if kernel == "gluon":
        return config(kernel, (Q_BUFFERS, STAGES, L2_BYTES >> 20))
    return config(kernel, default_tiles(head_dim, tma=kernel != "pointer"))


def describe(row: dict) -> str:
    """A sweep row's configuration in words."""
    if row["kernel"] == "gluon":
        return (f"gluon q_buffers={row['q_buffers']} stages={row['stages']} "
                f"l2_mib={row['l2_mib']}")
    return (f"{row['kernel']} block_m={row['block_m']} block_n={row['block_n']} "
            f"warps={row['warps']} stages={row['stages']}")


def prefill_case(batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int,
                 sweep: bool = True, kernels: tuple[str, ...] = ("pointer",)) -> dict:
    """Gives the prefill sweep of `kernels` and torch's SDPA backends for one causal shape;
    the baseline (`of_sdpa`) is the fastest backend."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = BF16 if device == "cuda" else torch.float32
    total = batch * tokens
    q = torch.randn(total, heads, head_dim, dtype=dtype, device=device)
    k, v = (torch.randn(total, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2))
    # no cached prefix: the cache is a placeholder the kernel never reads
    cache = torch.zeros(2, 1, 16, kv_heads, head_dim, dtype=dtype, device=device)
    tables = torch.zeros(batch, 1, dtype=torch.int32, device=device)
    starts = torch.arange(0, total + 1, tokens, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), tokens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    flops = 4 * batch * heads * tokens * tokens * head_dim / 2

    def as_bhnd(x):
        return x.view(batch, tokens, x.shape[1], head_dim).transpose(1, 2)

    backends, out = sdpa_baselines(as_bhnd(q), as_bhnd(k), as_bhnd(v), scale, flops)
    ref = out.transpose(1, 2).reshape(total, heads, head_dim)
    fastest = min((r for r in backends if "ms" in r), key=lambda r: r["ms"])
    sdpa_ms = fastest["ms"]
    rows = []
    for kernel in kernels:
        for c in [config(kernel, values) for values in SWEEP[kernel]] if sweep else [
                default_config(kernel, head_dim)]:
            if kernel == "gluon":
                run = functools.partial(gluon_prefill_attention, q, k, v, starts, tokens, scale,
                                        q_buffers=c["q_buffers"], stages=c["stages"],
                                        l2_bytes=c["l2_mib"] << 20)
            elif c["block_m"] % c["block_n"]:
                continue
            else:
                run = functools.partial(
                    paged_prefill_attention, q, k, v, cache, tables, starts, seq_lens, tokens,
                    scale, block_m=c["block_m"], block_n=c["block_n"], num_warps=c["warps"],
                    num_stages=c["stages"], use_tma=kernel == "tma", use_gluon=False)
            try:
                err = rel_err(run(), ref)
                ms = median_ms(run) if err < 2e-2 else float("nan")
            except Exception as exc:
                rows.append(c | {"error": str(exc)[:120]})
                continue
            rows.append(c | {"rel_err_vs_sdpa": err, "ms": ms, "tflops": flops / ms / 1e9,
                             "of_sdpa": sdpa_ms / ms})
        done = [r for r in rows if r["kernel"] == kernel and "ms" in r and r["ms"] == r["ms"]]
        print(f"prefill B={batch} N={tokens} {heads}q/{kv_heads}kv {kernel}: best "
              f"{max((r['of_sdpa'] for r in done), default=float('nan')):.3f} of "
              f"{fastest['backend']} ({len(done)} configs ran)", flush=True)
    timed = [r for r in rows if r.get("ms", float("nan")) == r.get("ms")]
    best = min(timed, key=lambda r: r["ms"])
    default = describe(default_config(default_kernel(), head_dim))
    launcher = next((r for r in timed if describe(r) == default), None)
    return {"batch": batch, "tokens": tokens, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "flops": flops, "sdpa_backends": backends,
            "sdpa_fastest": fastest["backend"], "sdpa_ms": sdpa_ms,
            "sdpa_tflops": fastest["tflops"], "best": best, "launcher_default": launcher,
            "sweep": rows}


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
                     f" GB/s | {b['of_copy']:.2f} | >= 0.92 | block_n={b['block_n']} "
                     f"warps={b['warps']} stages={b['stages']} splits={b['splits']} |")
    for p in result["prefill"]:
        b = p["best"]
        lines.append(f"| b) prefill | B={p['batch']} N={p['tokens']} {p['heads']}q/"
                     f"{p['kv_heads']}kv d{p['head_dim']} causal | {b['tflops']:.0f} TFLOP/s "
                     f"({b['ms']:.2f} ms) | SDPA {p['sdpa_fastest']} (fastest) "
                     f"{p['sdpa_tflops']:.0f} TFLOP/s | {b['of_sdpa']:.2f} | >= 1.0 | "
                     f"{describe(b)} |")
    lines += ["", "Every SDPA backend, TFLOP/s (GQA: how it ran):", ""]
    for p in result["prefill"]:
        said = ", ".join(f"{r['backend']} {r['tflops']:.0f} ({r['gqa']})" if "ms" in r
                         else f"{r['backend']} did not run ({r['error'][:80]})"
                         for r in p["sdpa_backends"])
        lines.append(f"- B={p['batch']} N={p['tokens']} {p['heads']}q/{p['kv_heads']}kv: {said}")
    lines += ["", "Launcher defaults (what the engine runs without tuning):", ""]
    for d in result["decode"]:
        r = d["launcher_default"]
        lines.append(f"- decode B={d['batch']} ctx={d['ctx']}: {r['of_copy']:.2f} of copy "
                     f"(splits={r['splits']})")
    for p in result["prefill"]:
        r = p["launcher_default"]
        if r:
            lines.append(f"- prefill B={p['batch']} N={p['tokens']} {p['heads']}q/"
                         f"{p['kv_heads']}kv: {r['of_sdpa']:.2f} of the fastest SDPA "
                         f"({describe(r)})")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--smoke", action="store_true",
                        help="CPU (TRITON_INTERPRET=1): one tiny prefill shape, no decode")
    parser.add_argument("--prefill-kernels", default=None,
                        help=f"comma-separated, of {', '.join(PREFILL_KERNELS)} (default: those "
                             "this device runs)")
    parser.add_argument("--no-decode", action="store_true", help="prefill only")
    parser.add_argument("--defaults-only", action="store_true",
                        help="prefill: each kernel at the launcher's default tiles, no sweep")
    args = parser.parse_args()
    kernels = tuple(args.prefill_kernels.split(",")) if args.prefill_kernels else (
        ("pointer", "tma", "gluon") if gluon_runs_here() else ("pointer",) if args.smoke
        else ("pointer", "tma"))
    if unknown := set(kernels) - set(PREFILL_KERNELS):
        parser.error(f"--prefill-kernels: unknown {sorted(unknown)}; "
                     f"choose from {', '.join(PREFILL_KERNELS)}")
    torch.manual_seed(0)
    if args.smoke:
        result = {"gpu": "cpu (smoke)", "date": datetime.date.today().isoformat(),
                  "torch": torch.__version__, "triton": triton.__version__,
                  "copy_gbps": 0.0, "matmul_tflops": 0.0, "decode": [],
                  "prefill": [prefill_case(2, 32, 4, 2, 16, sweep=False, kernels=kernels)]}
    else:
        result = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                  "torch": torch.__version__, "triton": triton.__version__,
                  "copy_gbps": copy_bandwidth(), "matmul_tflops": matmul_tflops()}
        result["decode"] = [] if args.no_decode else [
            decode_case(b, c, 32, 8, 128, 16, result["copy_gbps"])
            for b, c in ((64, 4096), (256, 1024))]
        torch.cuda.empty_cache()
        result["prefill"] = [prefill_case(b, n, h, kvh, 128, sweep=not args.defaults_only,
                                          kernels=kernels)
                             for b, n, h, kvh in PREFILL_SHAPES]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (out / "attention.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
