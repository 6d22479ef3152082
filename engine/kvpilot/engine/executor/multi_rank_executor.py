"""The driver's executor of a tensor-parallel engine (global rank 0); the pipeline-parallel
one (`parallel.pipeline_executor`) builds on it.

It starts this node's other ranks as worker processes, joins the process groups,
loads rank 0's shard, and then runs each step twice over: it broadcasts the packed
step to the workers (`StepChannel`) and runs rank 0's shard of it itself. The
workers' collectives meet rank 0's inside the forward; the logits are gathered to
rank 0, which samples. A worker's death reaches the engine as an error from
`execute` (gloo raises when a peer's sockets close; the watchdog names the worker)
and, between steps, through `on_failure`, so the server can stop serving at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.rendezvous import Rendezvous
from kvpilot.engine.executor.processes import WorkerProcesses
from kvpilot.engine.executor.step_channel import StepChannel
from kvpilot.engine.parallel.config import ParallelConfig
from kvpilot.engine.parallel.distributed import destroy_distributed, init_distributed
from kvpilot.engine.parallel.symm_mem_all_reduce import with_symm_mem
from kvpilot.engine.worker.kv_shards import write_blocks
from kvpilot.engine.worker.model_runner import ModelRunner
from kvpilot.engine.worker.startup_log import LoadReport
from kvpilot.engine.worker.step_batch import BatchEntry, unpack_step

if TYPE_CHECKING:
    from kvpilot.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)
# after a collective fails, how long to wait for the watchdog to see which worker died
EXIT_NOTICE_S = 3.0
# how long shutdown waits for a step in flight before it stops the workers by signal
SHUTDOWN_STEP_WAIT_S = 10.0


class WorkerLostError(RuntimeError):
    """A worker process of a parallel engine died; the engine cannot continue."""


class MultiRankExecutor:
    """Broadcasts each step to the workers and runs rank 0's shard (see the module doc)."""

    def __init__(self, args: EngineArgs, model_config: ModelConfig, device_type: str,
                 parallel: ParallelConfig, rendezvous: Rendezvous) -> None:
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        # a step's sends and the stop step never interleave on the host group
        self._step_lock = threading.Lock()
        self.failure: str | None = None
        workers = [r for r in rendezvous.local_ranks if r != 0]
        self.workers = WorkerProcesses(args, rendezvous, workers, self._on_worker_exit)
        try:
            self.ctx = with_symm_mem(init_distributed(parallel, rendezvous, 0, device_type,
                                                      model_config.num_layers),
                                     args, model_config, rendezvous)
            self.runner = ModelRunner(args, model_config, self.ctx.device, self.ctx.tp,
                                      self.ctx.min_over_ranks, self.ctx.stage)
        except BaseException as exc:
            message = self.workers.wait_for_exit(0.5)
            self.workers.stop(grace=0.0)
            destroy_distributed()
            if message is not None:
                raise WorkerLostError(f"{message} (while starting)") from exc
            raise
        self.channel = StepChannel(self.ctx)
        self._stopped = False
        logger.info("parallel engine: %d ranks (TP %d x PP %d), %d KV blocks per rank",
                    parallel.world_size, parallel.tensor_parallel_size,
                    parallel.pipeline_parallel_size, self.runner.num_blocks)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def num_graph_steps(self) -> int:
        return self.runner.num_graph_steps

    @property
    def num_piecewise_steps(self) -> int:
        return self.runner.num_piecewise_steps

    @property
    def num_eager_steps(self) -> int:
        return self.runner.num_eager_steps

    def load_report(self) -> LoadReport:
        return self.runner.load_report()

    def execute(self, entries: list[BatchEntry], copies: list[tuple[int, int]],
                prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Runs one step on every rank; gives rank 0's gathered logits rows (model dtype)."""
        if self.failure is not None:
            raise WorkerLostError(self.failure)
        packed, buf = self.runner.pack(entries, copies, prev_tokens)
        try:
            with self._step_lock:
                if self._stopped:
                    raise RuntimeError("the tensor-parallel executor was shut down")
                self.channel.send(packed.header, buf, prev_tokens)
                return self.runner.run(unpack_step(packed.header, buf, packed.host),
                                       prev_tokens)
        except RuntimeError as exc:
            raise self._step_failed(exc) from exc

    def _step_failed(self, exc: RuntimeError) -> RuntimeError:
        """Gives the error a failed step raises: WorkerLostError naming the worker that died,
        when the watchdog sees one exit soon, else `exc` itself."""
        message = self.workers.wait_for_exit(EXIT_NOTICE_S)
        if message is None:
            return exc
        self.failure = message
        return WorkerLostError(message)

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Writes whole-head KV blocks (uint8 [n, block_bytes], on the driver's device) into
        every rank's shard of the cache: the workers get them over the step channel, before
        the next step, and keep their heads (a decode engine's pulled KV)."""
        config = self.runner.config
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        with self._step_lock:
            if self._stopped:
                raise RuntimeError("the tensor-parallel executor was shut down")
            self.channel.send_load(index, data.contiguous())
            write_blocks(self.runner.kv_caches, index, data,
                         self.ctx.tp.kv_heads(config.num_kv_heads), config.num_kv_heads)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Has `callback(reason)` called from the watchdog thread when a worker dies."""
        with self._lock:
            self._listeners.append(callback)
            failure = self.failure
        if failure is not None:
            callback(failure)

    def _on_worker_exit(self, message: str) -> None:
        with self._lock:
            self.failure = message
            listeners = list(self._listeners)
        for callback in listeners:
            callback(message)

    def _send_stop(self) -> None:
        """Tells every worker to leave its loop."""
        self.channel.send_stop()

    def shutdown(self) -> None:
        """Stops the workers (a stop step, then signals) and leaves the process groups."""
        if self._stopped:
            return
        self.workers.expect_exits()
        stepping = not self._step_lock.acquire(timeout=SHUTDOWN_STEP_WAIT_S)
        self._stopped = True
        clean = self.failure is None and not stepping
        if clean:
            try:
                self._send_stop()
            except RuntimeError as exc:  # a worker already gone: stop the rest by signal
                logger.warning("stop step not delivered (%s)", exc)
                clean = False
        if not stepping:
            self._step_lock.release()
        self.runner.release_graphs()  # before leaving the groups (see DecodeGraphs.release)
        if clean:  # every rank leaves the groups together (see destroy_distributed)
            destroy_distributed()
            self.workers.stop(grace=10.0)
        else:
            self.workers.stop(grace=0.0)
            destroy_distributed(wait_s=5.0)
