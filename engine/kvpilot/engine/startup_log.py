"""The lines an engine logs while it starts: what it loads, how big, how long, what it can hold.

A platform engineer reading a pod's log during the minutes before /health answers sees
the model, dtype, device and topology first, then the weights (bytes and seconds), the KV
cache (blocks, tokens, bytes, where the budget came from), CUDA graphs, and the total.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from kvpilot.engine.contracts.args import EngineArgs

logger = logging.getLogger("kvpilot.engine")
Item = TypeVar("Item")
GIB = 2**30


def gib(num_bytes: int) -> str:
    """Gives a byte count as '12.34 GiB'."""
    return f"{num_bytes / GIB:.2f} GiB"


def kv_budget_source(args: EngineArgs, device_type: str) -> str:
    """Gives which setting sized the KV cache."""
    if args.num_kv_blocks is not None:
        return f"--num-kv-blocks {args.num_kv_blocks}"
    if args.kv_cache_memory is not None:
        return f"--kv-cache-memory {args.kv_cache_memory}"
    if device_type != "cuda":
        return "the CPU default of 256MiB"
    return f"what --gpu-memory-utilization {args.gpu_memory_utilization} leaves after a " \
           "profiling forward"


def log_model(args: EngineArgs, architecture: str, num_layers: int, dtype: str,
              device: str) -> None:
    logger.info("loading model %s (%s, %d layers) as %s, dtype %s, on %s; topology "
                "tensor_parallel_size=%d pipeline_parallel_size=%d expert_parallel_size=%d",
                args.model, architecture, num_layers, args.name, dtype, device,
                args.tensor_parallel_size, args.pipeline_parallel_size,
                args.expert_parallel_size)


def log_weights(num_bytes: int, seconds: float, load_format: str) -> None:
    logger.info("weights: %d bytes (%s, %s) loaded in %.2fs", num_bytes, gib(num_bytes),
                load_format, seconds)


def log_kv_cache(num_blocks: int, block_size: int, bytes_per_block: int, source: str) -> None:
    logger.info("KV cache: %d blocks x %d tokens = %d tokens, %s (sized by %s)", num_blocks,
                block_size, num_blocks * block_size, gib(num_blocks * bytes_per_block), source)


def log_graphs(sizes: list[int] | None, seconds: float, why_not: str) -> None:
    if sizes is None:
        logger.info("CUDA graphs: none (%s)", why_not)
    else:
        logger.info("CUDA graphs: captured %d decode batch sizes (%d..%d) in %.2fs",
                    len(sizes), min(sizes), max(sizes), seconds)


def log_ready(seconds: float, max_model_len: int, max_num_seqs: int) -> None:
    logger.info("engine ready in %.2fs: max_model_len=%d, max_num_seqs=%d", seconds,
                max_model_len, max_num_seqs)


def progress(items: Iterable[Item], total: int, desc: str) -> Iterator[Item]:
    """Gives `items`, with a progress bar on stderr when it is an interactive terminal (a pod's
    log is not: there the log lines above say enough)."""
    if total <= 1 or not sys.stderr.isatty():
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, total=total, desc=desc, unit="file", file=sys.stderr, leave=False)
