"""The engine's parallel topology, and the check that refuses what it cannot run.

`validate` runs at start-up, after config.json is parsed and before any weight is
loaded or process started. Supported: tensor parallelism (TP) that divides the
attention heads, the KV heads (or is a multiple of them: KV heads replicated) and
the MLP's intermediate size; expert parallelism (EP) on MoE models with EP == 1
(every expert TP-sharded) or EP == TP (experts partitioned whole across the TP
ranks); pipeline parallelism (PP) up to one stage per layer (`contracts/pipeline.py`),
times TP. Refused, each with the flag, the value and what is supported: more stages
than layers, `--async-scheduling on` with PP (a stage's steps are collected apart,
not overlapped with sampling), 1 < EP < TP, EP on a dense model, more ranks per node
than visible GPUs, a prefill role with more than one rank (its KV agent reads one
rank's whole cache), and a decode role with pipeline or expert parallelism. A decode
engine may run tensor-parallel: pulled blocks carry every KV head and each rank keeps
its own (`kv_connector.kv_shards`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvpilot.engine.contracts.args import EngineArgs

if TYPE_CHECKING:
    import torch


class ModelShape(Protocol):
    """What the topology checks and the all-reduce's sizing read of a model
    (`models.config.ModelConfig` is one; parallel/ sits below the models)."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    num_experts: int
    dtype: torch.dtype


class ParallelConfigError(ValueError):
    """A topology the engine refuses; the message names the flag, the value and the fix."""


@dataclass(frozen=True)
class ParallelConfig:
    """TP x PP ranks; EP splits each MoE layer's experts within its TP ranks."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> ParallelConfig:
        return cls(args.tensor_parallel_size, args.pipeline_parallel_size,
                   args.expert_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def coordinates(self, rank: int) -> tuple[int, int]:
        """Gives (pipeline rank, tensor rank) of global rank `rank` (TP ranks are adjacent)."""
        return divmod(rank, self.tensor_parallel_size)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_tensor(tp: int, config: ModelShape) -> None:
    flag = f"--tensor-parallel-size={tp}"
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % tp:
        raise ParallelConfigError(
            f"{flag} does not divide the model's {heads} attention heads: each rank needs whole "
            f"heads; use one of {_divisors(heads)}")
    if tp > kv_heads and tp % kv_heads:
        raise ParallelConfigError(
            f"{flag} exceeds the model's {kv_heads} KV heads but is not a multiple of them: KV "
            f"heads are replicated whole; use a multiple of {kv_heads} or one of "
            f"{_divisors(kv_heads)}")
    if tp <= kv_heads and kv_heads % tp:
        raise ParallelConfigError(
            f"{flag} does not divide the model's {kv_heads} KV heads: use one of "
            f"{_divisors(kv_heads)}")
    if config.intermediate_size % tp:
        what = "experts' intermediate size" if config.num_experts else "intermediate size"
        raise ParallelConfigError(
            f"{flag} does not divide the model's {what} {config.intermediate_size}: each rank "
            f"holds an equal slice of the MLP; use one of {_divisors(config.intermediate_size)}")


def _check_expert(tp: int, ep: int, config: ModelShape) -> None:
    flag = f"--expert-parallel-size={ep}"
    if ep == 1:
        return
    if not config.num_experts:
        raise ParallelConfigError(
            f"{flag} but {config.architecture} is a dense model (no experts): use "
            "--expert-parallel-size 1")
    if config.num_experts % ep:
        raise ParallelConfigError(
            f"{flag} does not divide the model's {config.num_experts} experts: use one of "
            f"{_divisors(config.num_experts)}")
    if ep != tp:
        raise ParallelConfigError(
            f"{flag} with --tensor-parallel-size={tp} is not supported: experts are split "
            f"across a layer's tensor-parallel ranks, so use --expert-parallel-size {tp} "
            "(experts partitioned whole) or 1 (every expert sharded across the ranks)")


def _check_pipeline(pp: int, config: ModelShape, async_scheduling: str) -> None:
    flag = f"--pipeline-parallel-size={pp}"
    if pp < 1 or pp > config.num_layers:
        raise ParallelConfigError(
            f"{flag} does not fit the model's {config.num_layers} layers: each stage holds at "
            f"least one whole layer; use 1 to {config.num_layers}")
    if pp > 1 and async_scheduling == "on":
        raise ParallelConfigError(
            f"--async-scheduling on with {flag} is not supported: pipeline stages overlap "
            "batches instead; use --async-scheduling auto or off")


def validate(parallel: ParallelConfig, config: ModelShape, device: str,
             visible_devices: int, role: str = "both", ranks_per_node: int | None = None,
             async_scheduling: str = "auto") -> None:
    """Raises ParallelConfigError for every topology the engine cannot run as asked.

    `device` is the resolved device type (cpu or cuda); `visible_devices` the GPUs
    this process sees; `ranks_per_node` the ranks this node runs (default: all).
    """
    tp, pp, ep = (parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                  parallel.expert_parallel_size)
    _check_pipeline(pp, config, async_scheduling)
    _check_tensor(tp, config)
    _check_expert(tp, ep, config)
    world = parallel.world_size
    if world == 1:
        return
    flags = f"--tensor-parallel-size={tp}" + (f" --pipeline-parallel-size={pp}" if pp > 1
                                              else "")
    if role == "prefill":
        raise ParallelConfigError(
            f"--role {role} with {flags} is not supported: the KV transfer moves one rank's "
            "whole cache, not a sharded one; use --role both, or --tensor-parallel-size 1 "
            "--pipeline-parallel-size 1 for prefill pools (decode pools may use TP)")
    if role == "decode" and (ep != 1 or pp != 1):
        raise ParallelConfigError(
            f"--role decode with --expert-parallel-size={ep} --pipeline-parallel-size={pp} "
            "is not supported: pulled KV is re-sharded for tensor parallelism only; use "
            "--expert-parallel-size 1 --pipeline-parallel-size 1")
    local = ranks_per_node or world
    if device == "cuda" and local > visible_devices:
        raise ParallelConfigError(
            f"{flags} needs {local} GPUs on this node but {visible_devices} are visible "
            "(CUDA_VISIBLE_DEVICES or the pod's GPU request): request more GPUs or lower "
            f"the ranks per node to {visible_devices} or less")
