"""The seam between the engine loop and the model: `ModelExecutor`, and the one to use.

`LLMEngine` schedules, samples and detokenises; it hands each step to its executor
(`runner.execute(entries, copies, prev_tokens) -> logits`) and reads the KV block
count, the device and the CUDA-graph counters back. On one rank the executor is the
`ModelRunner` itself; with tensor parallelism it is the driver's
`parallel.executor.MultiRankExecutor`, which broadcasts each step to the workers and
runs rank 0's shard.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.rendezvous import Rendezvous
from kvpilot.engine.parallel.config import ParallelConfig, ParallelConfigError, validate
from kvpilot.engine.worker.startup_log import LoadReport, log_topology

if TYPE_CHECKING:
    from kvpilot.engine.models.config import ModelConfig
    from kvpilot.engine.worker.step_batch import BatchEntry


class ModelExecutor(Protocol):
    """Runs scheduled steps on the model, wherever its ranks are."""

    @property
    def device(self) -> torch.device: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_graph_steps(self) -> int: ...

    @property
    def num_piecewise_steps(self) -> int: ...

    @property
    def num_eager_steps(self) -> int: ...

    def execute(self, entries: list[BatchEntry], copies: list[tuple[int, int]],
                prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Runs one step; gives logits (model dtype) for the rows `entries` ask for, in entry order."""
        ...

    def load_report(self) -> LoadReport:
        """Gives what rank 0 loaded and sized while starting (the start-up log's numbers)."""
        ...

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Has `callback(reason)` called, from another thread, if the executor breaks
        between steps (a worker process died)."""
        ...

    def shutdown(self) -> None:
        """Stops the executor's processes (none on one rank)."""
        ...


def make_executor(args: EngineArgs, model_config: ModelConfig, device: torch.device,
                  env: Mapping[str, str] = os.environ,
                  share_kv_blocks: Callable[[int], int] | None = None) -> ModelExecutor:
    """Gives the executor `args` ask for, after refusing any topology the engine cannot run
    (before a weight is loaded or a process started); `share_kv_blocks` turns one rank's
    own KV block count into what it keeps when a draft model shares the budget."""
    from kvpilot.engine.worker.model_runner import ModelRunner

    parallel = ParallelConfig.from_engine_args(args)
    rendezvous = Rendezvous.from_env(env, parallel.world_size)
    visible = torch.cuda.device_count() if device.type == "cuda" else 0
    validate(parallel, model_config, device.type, visible, args.role,
             rendezvous.ranks_per_node if rendezvous else None, args.async_scheduling)
    if args.kv_offload_gb > 0 and parallel.world_size > 1:
        raise ParallelConfigError(
            f"--kv-offload-gb={args.kv_offload_gb} with {parallel.world_size} ranks is not "
            "supported: the host tier copies one rank's whole cache; use "
            "--tensor-parallel-size 1, or drop --kv-offload-gb")
    log_topology(parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                 parallel.expert_parallel_size, rendezvous.nnodes if rendezvous else 1,
                 model_config.num_experts)
    if parallel.world_size == 1:
        return ModelRunner(args, model_config, device, agree_num_blocks=share_kv_blocks)
    from kvpilot.engine.executor.multi_rank_executor import MultiRankExecutor
    from kvpilot.engine.executor.processes import free_port

    if rendezvous is None:
        rendezvous = Rendezvous.local(parallel.world_size, free_port())
    if not rendezvous.is_driver_node:
        raise ParallelConfigError(
            f"NODE_RANK={rendezvous.node_rank}: only node rank 0 runs the engine; the other "
            "pods of a group run workers only (`kvpilot serve` does that by itself)")
    if parallel.pipeline_parallel_size > 1:
        from kvpilot.engine.executor.pipeline_executor import PipelineExecutor

        return PipelineExecutor(args, model_config, device.type, parallel, rendezvous)
    return MultiRankExecutor(args, model_config, device.type, parallel, rendezvous)
