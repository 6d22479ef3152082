"""Probe: is there read bandwidth above copy bandwidth for decode attention to use?

1. copy (read+write counted), torch.sum (read), a Triton streaming read at a few tilings.
2. the decode kernel on Qwen3-0.6B's attention (16 q / 8 KV heads, d128, 16-token blocks at
   random) at B=256 x 1024 and B=64 x 4096 and B=32 x 1500, 28 layers over 4 caches in a graph, at
   several (block_n, warps, stages).
"""
import itertools
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, "kernels")
from kvpilot.kernels.paged_decode_attention import default_num_splits, paged_decode_attention  # noqa: E402


@triton.jit
def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PROGS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, PROGS * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def main():
    n = 1 << 30
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * n * 2 / do_bench(lambda: dst.copy_(src), warmup=25, rep=200,
                                return_mode="median") / 1e6
    print(f"copy {copy:.0f} GB/s")
    del dst
    s = do_bench(lambda: src.sum(), warmup=25, rep=200, return_mode="median")
    print(f"torch.sum read {n * 2 / s / 1e6:.0f} GB/s ({n * 2 / s / 1e6 / copy:.3f} of copy)")
    best = 0.0
    for block, mult, warps in itertools.product([1024, 2048, 4096], [2, 4, 8], [4, 8]):
        progs = 132 * mult
        out = torch.empty(progs, dtype=torch.float32, device="cuda")
        ms = do_bench(lambda: _read[(progs,)](src, out, n, BLOCK=block, PROGS=progs,
                                              num_warps=warps), warmup=25, rep=100,
                      return_mode="median")
        gbps = n * 2 / ms / 1e6
        best = max(best, gbps)
        print(f"triton read block {block} progs {progs} warps {warps}: {gbps:.0f} GB/s")
    print(f"best streaming read {best:.0f} GB/s = {best / copy:.3f} of copy")
    del src
    heads, kvh, d, bs = 16, 8, 128, 16
    for b, ctx in [(256, 1024), (64, 4096), (128, 1200), (32, 1500)]:
        nb = b * ctx // bs
        caches = [torch.randn(2, nb * 3 // 2, bs, kvh, d, dtype=torch.bfloat16, device="cuda")
                  for _ in range(4)]
        perm = torch.randperm(nb * 3 // 2, device="cuda")[:nb].to(torch.int32)
        tables = perm.view(b, ctx // bs)
        seq_lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(b, heads, d, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(q)
        byts = b * ctx * kvh * d * 2 * 2 * 28
        splits = default_num_splits(b, kvh, 4096)
        for block_n, warps, stages in [(64, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3),
                                       (128, 4, 2), (128, 8, 2), (128, 8, 3), (32, 4, 4),
                                       (32, 4, 6), (64, 2, 3), (16, 4, 6)]:
            def layers():
                for i in range(28):
                    paged_decode_attention(q, caches[i % 4], tables, seq_lens, d ** -0.5,
                                           num_splits=splits, out=out, block_n=block_n,
                                           num_warps=warps, num_stages=stages)
            try:
                layers()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    layers()
                ms = do_bench(g.replay, warmup=10, rep=100, return_mode="median")
            except Exception as e:  # noqa: BLE001
                print(f"B={b} ctx={ctx} bn {block_n} w {warps} s {stages}: {type(e).__name__}")
                continue
            gbps = byts / ms / 1e6
            print(f"B={b} ctx={ctx} splits {splits} bn {block_n} w {warps} s {stages}: "
                  f"{gbps:.0f} GB/s {gbps / copy:.3f} of copy")
        del caches


if __name__ == "__main__":
    main()
