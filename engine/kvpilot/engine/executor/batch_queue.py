"""The batches a pipeline-parallel engine has in flight, oldest first.

As vLLM V1's batch queue (`max_concurrent_batches = pipeline_parallel_size`,
`step_with_batch_queue`): while the queue has room, each engine step schedules a new
batch from the sequences not already in flight and submits it, returning at once; when
the queue is full, or nothing new could be scheduled, the step waits for the oldest
batch's logits and books it as a synchronous step would. A sequence is in at most one
batch in flight (`busy`), so a batch never depends on one still in the pipeline.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from kvpilot.engine.core.scheduler import SchedulerOutput
    from kvpilot.engine.worker.step_batch import BatchEntry


@runtime_checkable
class PipelinedExecutor(Protocol):
    """An executor whose steps are submitted and collected apart, in order."""

    max_concurrent_batches: int

    def submit(self, entries: list[BatchEntry], copies: list[tuple[int, int]]) -> None:
        """Starts one step; its logits come from a later `collect`."""
        ...

    def collect(self) -> torch.Tensor:
        """Gives the oldest submitted step's logits rows (model dtype)."""
        ...


@dataclass
class InFlightBatch:
    """A submitted batch: its plan and the entries its logits rows follow."""

    plan: SchedulerOutput
    entries: list[BatchEntry]


class BatchQueue:
    """The engine's batches in the pipeline (see the module doc)."""

    def __init__(self, executor: PipelinedExecutor) -> None:
        self.executor = executor
        self.batches: deque[InFlightBatch] = deque()
        self.busy: set[int] = set()  # ids of the sequences in a batch in flight

    @property
    def has_room(self) -> bool:
        """Gives whether another batch may enter the pipeline."""
        return len(self.batches) < self.executor.max_concurrent_batches

    def submit(self, plan: SchedulerOutput, entries: list[BatchEntry]) -> None:
        """Starts `plan`'s batch down the pipeline."""
        self.executor.submit(entries, plan.block_copies)
        self.batches.append(InFlightBatch(plan, entries))
        self.busy.update(seq.seq_id for seq, _ in plan.scheduled)

    def collect(self) -> tuple[InFlightBatch, torch.Tensor]:
        """Gives the oldest batch and its logits rows, once the last stage sent them."""
        logits = self.executor.collect()
        batch = self.batches.popleft()
        self.busy.difference_update(seq.seq_id for seq, _ in batch.plan.scheduled)
        return batch, logits
