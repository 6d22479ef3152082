"""Decode attention with one split: the kernel at a given commit against this tree's, same call.

Times `paged_decode_attention(..., num_splits=1)` (the launcher's defaults) of the kernel file
at `--commit` (loaded from git into a temporary module) and of the working tree's, in three
alternating rounds per shape, and checks that both give the same output. Made to measure the
one-split path that writes its output itself (no merge kernel) against the split+merge one.

    python3 bench/kernels/decode_direct_ab.py [--commit 46aee51]   # CUDA
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
from pathlib import Path
from types import ModuleType

import torch
from triton.testing import do_bench

from kvpilot.kernels import paged_decode_attention as current

KERNEL = "kernels/kvpilot/kernels/paged_decode_attention.py"


def kernel_at(commit: str) -> ModuleType:
    """Gives the decode kernel module as it was at `commit`."""
    source = subprocess.run(["git", "show", f"{commit}:{KERNEL}"], capture_output=True,
                            text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "decode_at_commit.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("decode_at_commit", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_one_split(module: ModuleType, q: torch.Tensor, cache: torch.Tensor,
                   tables: torch.Tensor, lens: torch.Tensor, scale: float) -> float:
    """Gives the median ms of `module`'s decode attention with one split."""
    out = torch.empty_like(q)
    return do_bench(lambda: module.paged_decode_attention(q, cache, tables, lens, scale, 1,
                                                          out=out), warmup=50, rep=300)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--commit", default="46aee51")
    args = parser.parse_args()
    before = kernel_at(args.commit)
    torch.manual_seed(0)
    block_size, kv_heads, heads, head_dim = 16, 8, 32, 128
    for batch, ctx in ((64, 4096), (256, 1024), (128, 2048)):
        num_blocks = batch * ctx // block_size
        cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16,
                            device="cuda")
        tables = torch.randperm(num_blocks, device="cuda").view(batch, -1).int()
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        scale = head_dim**-0.5
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(3):
            for name, module in (("before", before), ("after", current)):
                times[name].append(time_one_split(module, q, cache, tables, lens, scale))
        a = current.paged_decode_attention(q, cache, tables, lens, scale, 1)
        b = before.paged_decode_attention(q, cache, tables, lens, scale, 1)
        gbps = cache.numel() * 2 / min(times["after"]) / 1e6
        print(f"B={batch} ctx={ctx}: before {[round(t * 1e3, 1) for t in times['before']]} us, "
              f"after {[round(t * 1e3, 1) for t in times['after']]} us, before/after "
              f"{min(times['before']) / min(times['after']):.3f}, after {gbps:.0f} GB/s, "
              f"max |diff| {(a.float() - b.float()).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
