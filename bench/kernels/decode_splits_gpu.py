"""Decode attention at tensor-parallel head counts: 1, 2 and 4 splits (the merge launch
included), median us per launch over a CUDA graph of 28 launches (one per layer), every
sequence at the same length; beside it what `default_num_splits` picks.

    python3 bench/kernels/decode_splits_gpu.py      # one GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / p) for p in ("bench", "tests/kernels", "tests")]
from paged_fixtures import random_paged_cache  # noqa: E402
from w8a16_gemv_gpu import graph_time_us  # noqa: E402

from kvpilot.kernels.paged_decode_attention import (  # noqa: E402
    default_num_splits,
    paged_decode_attention,
)

LAYERS = 28


def time_splits(batch: int, heads: int, kv_heads: int, ctx: int, splits: int) -> float:
    gen = torch.Generator().manual_seed(0)
    lens = [ctx] * batch
    cache, tables = random_paged_cache(lens, kv_heads, 128, 16, torch.bfloat16, "cuda", gen)
    q = torch.randn(batch, heads, 128).to(torch.bfloat16).cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    return graph_time_us(
        lambda _: paged_decode_attention(q, cache, tables, seq_lens, 0.088, splits, out=out),
        calls=LAYERS)


def main() -> None:
    for batch, heads, kv_heads in ((64, 16, 4), (64, 8, 2), (32, 16, 4), (128, 16, 4),
                                   (64, 32, 8)):
        for ctx in (192, 1024, 4096):
            row = " ".join(f"s{s}={time_splits(batch, heads, kv_heads, ctx, s):.2f}us"
                           for s in (1, 2, 4))
            print(f"B={batch} {heads}/{kv_heads} ctx={ctx}: {row}  default(1024)="
                  f"{default_num_splits(batch, kv_heads, 1024)} default(ctx)="
                  f"{default_num_splits(batch, kv_heads, ctx)}", flush=True)


if __name__ == "__main__":
    main()
