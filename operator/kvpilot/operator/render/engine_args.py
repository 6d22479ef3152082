"""The `kvpilot serve` command line of one pool, built from the shared EngineArgs/ServerArgs contract."""

from __future__ import annotations

from kvpilot.engine.contracts.args import EngineArgs, ServerArgs
from kvpilot.operator.planning.pool import ResolvedPool
from kvpilot.operator.render.meta import ENGINE_PORT
from kvpilot.operator.render.weights import model_location


def serve_args(pool: ResolvedPool, drain_timeout: int) -> list[str]:
    """Gives the arguments after `kvpilot serve` for a resolved pool."""
    engine, topo = pool.engine, pool.topology
    location = model_location(pool.model, pool.model_ref)
    args = EngineArgs(
        model=location.engine_model,
        served_model_name=pool.model.name,
        load_format=location.load_format,
        dtype=engine.dtype,
        device="cpu" if pool.accelerator.vendor == "cpu" else "cuda",
        max_model_len=engine.max_model_len,
        block_size=engine.block_size,
        kv_cache_memory=engine.kv_cache_memory,
        gpu_memory_utilization=engine.gpu_memory_utilization or EngineArgs.gpu_memory_utilization,
        enable_prefix_caching=engine.enable_prefix_caching,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        tensor_parallel_size=topo.tensor_parallel,
        pipeline_parallel_size=topo.pipeline_parallel,
        expert_parallel_size=topo.expert_parallel,
        role=pool.role,
    )
    server = ServerArgs(host="0.0.0.0", port=ENGINE_PORT, drain_timeout=float(drain_timeout))
    return [*args.to_cli(), *server.to_cli(), *engine.extra_args]
