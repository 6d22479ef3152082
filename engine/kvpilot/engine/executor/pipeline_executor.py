"""The driver's executor of a pipeline-parallel engine (global rank 0, first stage).

Steps are submitted and collected apart, so up to `max_concurrent_batches` (the
pipeline depth) are in the pipe at once: `submit` broadcasts a step to the first
stage's other TP ranks, runs the driver's shard of the first stage and hands the
activations to the next stage without waiting for it; `collect` waits for the oldest
step's logits rows from the last stage. The engine loop (`engine.batch_queue`)
schedules the next batch while earlier ones are still in the pipe, as vLLM V1's
`step_with_batch_queue` does. Start-up, the watchdog and failure handling are the
tensor-parallel executor's.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.rendezvous import Rendezvous
from kvpilot.engine.executor.multi_rank_executor import (
    MultiRankExecutor,
    WorkerLostError,
)
from kvpilot.engine.executor.pipe_channel import PipeChannel
from kvpilot.engine.parallel.config import ParallelConfig
from kvpilot.engine.parallel.stage import Intermediate
from kvpilot.engine.worker.step_batch import BatchEntry, unpack_step

if TYPE_CHECKING:
    from kvpilot.engine.models.config import ModelConfig


class PipelineExecutor(MultiRankExecutor):
    """Runs the first stage of each step and collects the last stage's logits (see above)."""

    def __init__(self, args: EngineArgs, model_config: ModelConfig, device_type: str,
                 parallel: ParallelConfig, rendezvous: Rendezvous) -> None:
        super().__init__(args, model_config, device_type, parallel, rendezvous)
        self.max_concurrent_batches = parallel.pipeline_parallel_size
        self.vocab_size = model_config.vocab_size
        self.pipe = PipeChannel(self.ctx, model_config.hidden_size, model_config.dtype)
        self._in_pipe: deque[int] = deque()  # logits rows of each submitted step, oldest first
        self.max_in_flight = 0  # the most steps ever in the pipe at once

    @property
    def num_in_flight(self) -> int:
        """Gives how many submitted steps have not been collected."""
        return len(self._in_pipe)

    def submit(self, entries: list[BatchEntry], copies: list[tuple[int, int]]) -> None:
        """Starts one step down the pipeline; its logits come from a later `collect`."""
        if self.failure is not None:
            raise WorkerLostError(self.failure)
        if len(self._in_pipe) >= self.max_concurrent_batches:
            raise RuntimeError(f"{len(self._in_pipe)} steps are already in the pipeline: "
                               "collect one before submitting another")
        packed, buf = self.runner.pack(entries, copies)
        try:
            with self._step_lock:
                if self._stopped:
                    raise RuntimeError("the pipeline-parallel executor was shut down")
                if self.ctx.tp.size > 1:
                    self.channel.send(packed.header, buf, None)
                out = self.runner.run_stage(unpack_step(packed.header, buf, packed.host), None)
                assert isinstance(out, Intermediate)  # the driver's stage is never the last
                self.pipe.send_next(packed.header, buf, out)
        except RuntimeError as exc:
            raise self._step_failed(exc) from exc
        self._in_pipe.append(packed.header.num_rows)
        self.max_in_flight = max(self.max_in_flight, len(self._in_pipe))

    def collect(self) -> torch.Tensor:
        """Gives the oldest submitted step's logits rows (model dtype), waiting for the last stage."""
        if self.failure is not None:
            raise WorkerLostError(self.failure)
        num_rows = self._in_pipe.popleft()
        if not num_rows:  # the last stage sends nothing for a step that samples no row
            return torch.empty((0, self.vocab_size), dtype=self.pipe.dtype, device=self.device)
        try:
            return self.pipe.receive_logits(num_rows, self.vocab_size)
        except RuntimeError as exc:
            raise self._step_failed(exc) from exc

    def execute(self, entries: list[BatchEntry], copies: list[tuple[int, int]],
                prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Runs one step through the whole pipeline; gives its logits rows."""
        if prev_tokens is not None:
            raise ValueError("async scheduling does not run with pipeline parallelism")
        self.submit(entries, copies)
        return self.collect()

    def _send_stop(self) -> None:
        """Collects the steps still in the pipe, then sends stop down it."""
        while self._in_pipe:
            self.collect()
        if self.ctx.tp.size > 1:
            self.channel.send_stop()
        self.pipe.send_stop_next()
        self.pipe.flush()
