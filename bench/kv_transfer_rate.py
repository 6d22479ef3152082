"""KV-transfer rate between two block stores in one process: the TCP agents' bulk path.

Pulls one long prompt's blocks (Llama-3.2-1B or Llama-3-8B shaped, bf16) from a
prefill-side store to a decode-side store through two `TcpConnector`s on
127.0.0.1, several times, and prints MB/s. Both agents share this process's GIL,
so it is a lower bound for two engines. On CUDA the caches live on the GPU(s)
(cuda:0 and, when present, cuda:1); on CPU, in host memory.

    python bench/kv_transfer_rate.py [--shape 1b|8b] [--tokens 6144] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.contracts.kv_client import request_pull
from kvpilot.engine.core.block_pool import BlockPool
from kvpilot.engine.kv_transfer.engine_store import EngineBlockStore
from kvpilot.engine.kv_transfer.tcp import TcpConnector

BLOCK = 16
SHAPES = {"1b": (16, 8, 64), "8b": (32, 8, 128)}  # layers, kv heads, head dim


def make_store(num_blocks: int, shape: str, device: str) -> EngineBlockStore:
    layers, heads, dim = SHAPES[shape]
    caches = [torch.randn(2, num_blocks, BLOCK, heads, dim, device=device).to(torch.bfloat16)
              for _ in range(layers)]
    return EngineBlockStore(BlockPool(num_blocks), caches, BLOCK)


async def pull_once(src: EngineBlockStore, dst: EngineBlockStore, tokens: list[int],
                    lease: str) -> float:
    prefill, decode = TcpConnector(src, "127.0.0.1", 0), TcpConnector(dst, "127.0.0.1", 0)
    prefill.start()
    decode.start()
    try:
        with src.lock:
            prefill.offer(lease, tokens)
        t0 = time.perf_counter()
        done = await request_pull(("127.0.0.1", decode.port), ("127.0.0.1", prefill.port),
                                  lease, timeout=120)
        elapsed = time.perf_counter() - t0
        assert done["imported"] == len(tokens) // BLOCK, done
        return elapsed
    finally:
        prefill.stop()
        decode.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--tokens", type=int, default=6144)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    devices = (["cuda:0", f"cuda:{min(1, torch.cuda.device_count() - 1)}"] if cuda
               else ["cpu", "cpu"])
    num_blocks = args.tokens // BLOCK
    src = make_store(num_blocks + 1, args.shape, devices[0])
    for rep in range(args.repeat):
        dst = make_store(num_blocks + 1, args.shape, devices[1])
        tokens = list(range(rep * 100000, rep * 100000 + num_blocks * BLOCK))
        hashes = hash_prompt_blocks(tokens, BLOCK)
        blocks = src.pool.allocate(num_blocks)  # computed: cached under the prompt's hashes
        for block, block_hash in zip(blocks, hashes, strict=True):
            src.pool.cache(block, block_hash)
        src.pool.free(blocks[::-1])
        elapsed = asyncio.run(pull_once(src, dst, tokens, f"lease-{rep}"))
        size = num_blocks * src.block_bytes
        print(f"{args.shape} {devices[0]}->{devices[1]}: {num_blocks} blocks, "
              f"{size / 1e6:.0f} MB in {elapsed:.3f} s = {size / elapsed / 1e6:.0f} MB/s",
              flush=True)


if __name__ == "__main__":
    main()
