"""The `kvpilot serve` command line of one pool, built from the shared EngineArgs/ServerArgs contract."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.engine.contracts.args import EngineArgs, ServerArgs
from kvpilot.operator.planning.pool import ResolvedPool
from kvpilot.operator.render.meta import ENGINE_PORT

MODEL_DIR = "/models"
HF_DIR = f"{MODEL_DIR}/hf"


@dataclass(frozen=True)
class ModelLocation:
    """Where the engine finds its weights inside the pod."""

    engine_model: str
    """Value of `--model`: a built-in config name or a directory in the pod."""
    load_format: str
    """auto or dummy."""
    pvc_claim: str | None = None
    """PersistentVolumeClaim mounted read-only at /models/<claim> (pvc:// sources)."""
    hf_repo: str | None = None
    """Hugging Face repository an init container downloads to /models/hf (hf:// sources)."""


def model_location(source: str) -> ModelLocation:
    """Gives where a `spec.model.source` ends up inside the pod."""
    if source.startswith("dummy:"):
        return ModelLocation(source.removeprefix("dummy:"), "dummy")
    if source.startswith("pvc://"):
        claim, _, path = source.removeprefix("pvc://").partition("/")
        return ModelLocation(f"{MODEL_DIR}/{claim}/{path}".rstrip("/"), "auto", pvc_claim=claim)
    if source.startswith("hf://"):
        return ModelLocation(HF_DIR, "auto", hf_repo=source.removeprefix("hf://"))
    raise ValueError(f"spec.model.source={source!r} is not supported: write hf://org/name, "
                     "pvc://claim/path or dummy:tiny-llama")


def serve_args(pool: ResolvedPool, drain_timeout: int) -> list[str]:
    """Gives the arguments after `kvpilot serve` for a resolved pool."""
    engine, topo = pool.engine, pool.topology
    location = model_location(pool.model.source)
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
    flags = args.to_cli()
    if "--model" not in flags:  # to_cli drops defaults; a pod's command should say what it serves
        flags = ["--model", args.model, *flags]
    return [*flags, *server.to_cli(), *engine.extra_args]
