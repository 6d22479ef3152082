"""The `kvpilot serve` command line of one pool, built from the shared EngineArgs/ServerArgs contract."""

from __future__ import annotations

import argparse
from typing import NoReturn

from kvpilot.engine.contracts.args import (
    EngineArgs,
    ServerArgs,
    add_dataclass_args,
    from_namespace,
)
from kvpilot.engine.contracts.fleet_secret import FLEET_SECRET_PATH
from kvpilot.operator.planning.pool import ResolvedPool
from kvpilot.operator.render.adapters import lora_args
from kvpilot.operator.render.meta import ENGINE_PORT
from kvpilot.operator.render.weights import model_location

# `kvpilot serve` flags the operator renders itself, and the field (or reason) that sets each.
OWNED_FLAGS = {
    "model": "spec.model.source", "served_model_name": "spec.model.name",
    "load_format": "spec.model.source", "dtype": "spec.engine.dtype",
    "device": "spec.accelerator.vendor", "max_model_len": "spec.engine.maxModelLen",
    "block_size": "spec.engine.blockSize", "kv_cache_memory": "spec.engine.kvCacheMemory",
    "gpu_memory_utilization": "spec.engine.gpuMemoryUtilization",
    "enable_prefix_caching": "spec.engine.enablePrefixCaching",
    "max_num_seqs": "spec.engine.maxNumSeqs",
    "max_num_batched_tokens": "spec.engine.maxNumBatchedTokens",
    "tensor_parallel_size": "spec.topology", "pipeline_parallel_size": "spec.topology",
    "expert_parallel_size": "spec.topology", "role": "the pool's kind and spec.servingMode",
    "host": "the pod network", "port": "the pod's probes and Service",
    "kv_transfer_port": "the pod's NetworkPolicy and Service",
    "drain_timeout": "the operator's --drain-timeout",
    "api_key": "spec.auth.apiKeySecretRef (never a key in a pod's args)",
    "fleet_secret_file": "the fleet Secret the operator mounts",
    "quantization": "spec.engine.quantization", "kv_cache_dtype": "spec.engine.kvCacheDtype",
    "speculative_config": "spec.engine.speculative",
    "enable_lora": "spec.adapters", "lora_modules": "spec.adapters",
    "max_loras": "spec.engine.maxLoras", "max_lora_rank": "spec.engine.maxLoraRank",
}


class _Refusal(argparse.ArgumentParser):
    """The engine's own flags, raising ValueError where `kvpilot serve` would exit."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _serve_parser() -> argparse.ArgumentParser:
    parser = _Refusal(prog="kvpilot serve", add_help=False, allow_abbrev=False)
    # `kvpilot serve MODEL` takes the model positionally too (engine/server/cli.py).
    parser.add_argument("model_tag", nargs="?", default=None)
    add_dataclass_args(parser, EngineArgs)
    add_dataclass_args(parser, ServerArgs)
    return parser


def check_extra_args(extra: list[str]) -> None:
    """Raises ValueError naming spec.engine.extraArgs when `kvpilot serve` would refuse them
    or when they set a flag (or the positional MODEL) the operator renders from a field."""
    given = [arg.split("=", 1)[0] for arg in extra if arg.startswith("--")]
    for flag in given:
        dest = flag.removeprefix("--").removeprefix("no-").replace("-", "_")
        if dest in OWNED_FLAGS:
            raise ValueError(f"spec.engine.extraArgs sets {flag}, which the operator renders "
                             f"from {OWNED_FLAGS[dest]}: remove it from extraArgs")
    try:
        parsed = _serve_parser().parse_args(extra)
        from_namespace(EngineArgs, parsed)
        from_namespace(ServerArgs, parsed)
    except ValueError as exc:
        raise ValueError(f"spec.engine.extraArgs={extra}: kvpilot serve refuses them ({exc}): "
                         "fix or remove the flag (kvpilot serve --help lists them)") from exc
    if parsed.model_tag is not None:
        raise ValueError(f"spec.engine.extraArgs names the model {parsed.model_tag!r}, which "
                         f"the operator renders from {OWNED_FLAGS['model']}: remove it from "
                         "extraArgs")


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
        fleet_secret_file=FLEET_SECRET_PATH,
        quantization=engine.quantization or EngineArgs.quantization,
        kv_cache_dtype=engine.kv_cache_dtype or EngineArgs.kv_cache_dtype,
        speculative_config=(engine.speculative.to_engine_config().to_json()
                            if engine.speculative else None),
    )
    server = ServerArgs(host="0.0.0.0", port=ENGINE_PORT, drain_timeout=float(drain_timeout))
    check_extra_args(engine.extra_args)
    line = [*args.to_cli(), *server.to_cli(), *lora_args(pool.adapters, engine),
            *engine.extra_args]
    if pool.adapters:
        check_lora_line(line)
    return line


def check_lora_line(line: list[str]) -> None:
    """Raises ValueError naming spec.adapters when the engine refuses a serve line with
    adapters (its LoRA limits, e.g. one GPU per replica), so the model fails at admission
    rather than its pods at start."""
    try:
        from_namespace(EngineArgs, _serve_parser().parse_args(line))
    except ValueError as exc:
        raise ValueError(f"spec.adapters: kvpilot serve refuses LoRA with these settings "
                         f"({exc}): change the field it names, or remove spec.adapters") from exc
