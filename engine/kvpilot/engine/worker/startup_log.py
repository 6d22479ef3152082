"""The lines an engine logs while it starts: what it loads, how big, how long, what it can hold.

A platform engineer reading a pod's log during the minutes before /health answers sees
the model, dtype and device first, then the topology the engine accepted (ranks, nodes,
how the experts are split), the weights (bytes and seconds), the KV cache (blocks, tokens,
bytes, where the budget came from), CUDA graphs, the warm-up, and the total. With tensor parallelism
the sizes are rank 0's (the driver's), said as per rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvpilot.engine.contracts.args import EngineArgs

logger = logging.getLogger("kvpilot.engine")
GIB = 2**30


@dataclass(frozen=True)
class WarmupReport:
    """What the warm-up ran (`engine.warmup`): requests, steps, seconds, the code paths."""

    requests: int = 0
    steps: int = 0
    seconds: float = 0.0
    max_prefill_tokens: int = 0
    paths: frozenset[str] = frozenset()
    skipped: str = ""  # why it did not run ("" when it ran)


@dataclass(frozen=True)
class LoadReport:
    """What one rank loaded and sized while starting: rank 0's with tensor parallelism."""

    weight_bytes: int
    load_seconds: float
    num_blocks: int
    block_size: int
    bytes_per_block: int
    graph_sizes: tuple[int, ...] | None
    """Decode batch sizes captured as CUDA graphs; None: none captured."""
    graph_seconds: float
    mixed_graph_tokens: tuple[int, ...] = ()
    """Token counts of the mixed steps' graphs (none: mixed steps run eagerly)."""
    mixed_graph_bytes: int = 0  # GPU memory the mixed graphs hold (pool, or pieces' q/k/v)
    mixed_graph_mode: str = "full"  # attention inside the graphs ("full") or "piecewise"


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
    logger.info("loading model %s (%s, %d layers) as %s, dtype %s, on %s", args.model,
                architecture, num_layers, args.name, dtype, device)


def log_topology(tp: int, pp: int, ep: int, nnodes: int, num_experts: int) -> None:
    """Logs the topology the engine accepted, before it loads a weight or starts a worker."""
    world = tp * pp
    ranks = "one rank" if world == 1 else \
        f"{world} ranks, {world // nnodes} per node on {nnodes} node{'s' if nnodes > 1 else ''}"
    experts = ""
    if num_experts and tp > 1:
        experts = f"; each rank holds {num_experts // ep} of {num_experts} experts whole" \
            if ep > 1 else f"; each rank holds a 1/{tp} slice of all {num_experts} experts"
    logger.info("topology: tensor_parallel_size=%d pipeline_parallel_size=%d "
                "expert_parallel_size=%d: %s%s", tp, pp, ep, ranks, experts)


def log_load(report: LoadReport, load_format: str, kv_budget: str, why_no_graphs: str,
             world_size: int) -> None:
    """Logs the weights, the KV cache and the CUDA graphs one rank set up (`report`)."""
    rank = "" if world_size == 1 else f" per rank (rank 0 of {world_size})"
    logger.info("weights: %d bytes (%s, %s)%s loaded in %.2fs", report.weight_bytes,
                gib(report.weight_bytes), load_format, rank, report.load_seconds)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens, %s%s (sized by %s)",
                report.num_blocks, report.block_size, report.num_blocks * report.block_size,
                gib(report.num_blocks * report.bytes_per_block), rank, kv_budget)
    sizes = report.graph_sizes
    if sizes is None:
        logger.info("CUDA graphs: none (%s)", why_no_graphs)
    else:
        tokens = report.mixed_graph_tokens
        mixed = (f" and {len(tokens)} mixed-step token counts ({min(tokens)}..{max(tokens)}, "
                 f"{report.mixed_graph_mode}, {gib(report.mixed_graph_bytes)})") if tokens else \
            " (mixed steps eager)"
        logger.info("CUDA graphs: captured %d decode batch sizes (%d..%d)%s%s in %.2fs",
                    len(sizes), min(sizes), max(sizes), mixed, rank, report.graph_seconds)


def log_warmup(report: WarmupReport) -> None:
    """Logs what the warm-up ran before the engine said ready (or why it did not)."""
    if report.skipped:
        logger.info("warm-up: skipped (%s)", report.skipped)
        return
    logger.info("warm-up: %d requests in %d steps, %.2fs: prefill up to %d tokens; %s",
                report.requests, report.steps, report.seconds, report.max_prefill_tokens,
                ", ".join(sorted(report.paths)))


def log_ready(seconds: float, max_model_len: int, max_num_seqs: int) -> None:
    logger.info("engine ready in %.2fs: max_model_len=%d, max_num_seqs=%d", seconds,
                max_model_len, max_num_seqs)
