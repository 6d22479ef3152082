"""Qwen3's fused q/k norm + rotary + KV write against the two launches it replaces
(`qk_norm_rotary` without the cache, then `kv_cache_write`), and its heads-per-program
choices: Qwen3-0.6B's attention (16 q, 8 KV heads, head_dim 128), bf16, 28 launches in one
CUDA graph, us a launch.

    python bench/kernels/qk_norm_rotary_gpu.py
"""

from __future__ import annotations

import torch

from kvpilot.kernels.kv_cache_write import kv_cache_write
from kvpilot.kernels.qk_norm_rotary import qk_norm_rotary
from kvpilot.kernels.rotary import rotary_cos_sin_cache

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 28


def us_per_launch(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / LAYERS * 1000


def main() -> None:
    dev, bf16 = "cuda", torch.bfloat16
    rope = rotary_cos_sin_cache(HEAD_DIM, 4096, device=dev)
    w = torch.ones(HEAD_DIM, dtype=bf16, device=dev)
    cache = torch.zeros(2, 4096, 16, KV_HEADS, HEAD_DIM, dtype=bf16, device=dev)
    print(torch.cuda.get_device_name())
    print("| tokens | two launches | fused, 1 head a program | 2 | 4 | 8 |")
    print("|---|---|---|---|---|---|")
    for tokens in (1, 64, 128, 256):
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=bf16, device=dev)
        q = qkv[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS,
                                                                        HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(tokens, KV_HEADS, HEAD_DIM)
        pos = torch.arange(tokens, device=dev)
        slots = torch.randperm(cache.shape[1] * cache.shape[2], device=dev)[:tokens]

        def unfused(q=q, k=k, v=v, pos=pos, slots=slots) -> None:
            qk_norm_rotary(pos, q, k, w, w, 1e-6, rope)
            kv_cache_write(k, v, cache, slots)

        row = [us_per_launch(unfused)]
        for per_program in (1, 2, 4, 8):
            row.append(us_per_launch(lambda n=per_program, q=q, k=k, v=v, pos=pos, slots=slots:
                                     qk_norm_rotary(pos, q, k, w, w, 1e-6, rope, v=v,
                                                    kv_cache=cache, slot_mapping=slots,
                                                    heads_per_program=n)))
        print(f"| {tokens} | " + " | ".join(f"{x:.2f}" for x in row) + " |")


if __name__ == "__main__":
    main()
