"""How each step reaches the workers of the driver's stage: a fixed-length header over the
stage's host group, then the step's packed buffer and (async scheduling) the sampled
tokens it patches from over its device group (the other pipeline stages get the step
from the stage before them: `parallel.pipe_channel`).

On CUDA the buffer goes device to device over NCCL, queued behind the driver's
host-to-device copy, and the sampled tokens behind the sampler's kernels (stream
order, no host wait); on CPU everything is gloo. Nothing is pickled per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from kvpilot.engine.parallel.distributed import RankContext
from kvpilot.engine.worker.step_batch import LOAD_KV, STOP, StepHeader, buffer_size

DRIVER = 0  # global rank that schedules, samples and broadcasts


@dataclass
class ReceivedStep:
    """One step as a worker received it."""

    header: StepHeader
    buf: torch.Tensor  # on the worker's device
    host: np.ndarray | None  # the buffer's host memory (CPU ranks), for host-side lengths
    prev_tokens: torch.Tensor | None


@dataclass
class ReceivedLoad:
    """Whole-head KV blocks a worker writes its heads of (`kv_connector.kv_shards`)."""

    block_ids: torch.Tensor  # [n] int64 on the worker's device
    data: torch.Tensor  # uint8 [n, block_bytes] on the worker's device


class StepChannel:
    """The driver's sends and the workers' receives of every step, in the same order."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.device_group = ctx.tp.group

    def send(self, header: StepHeader, buf: torch.Tensor,
             prev_tokens: torch.Tensor | None) -> None:
        """Broadcasts one step from the driver (its buffer already on the driver's device)."""
        dist.broadcast(header.to_tensor(), DRIVER, group=self.ctx.stage_host_group)
        dist.broadcast(buf, DRIVER, group=self.device_group)
        if header.num_patched:
            assert prev_tokens is not None  # pack_step counted them
            dist.broadcast(prev_tokens.contiguous(), DRIVER, group=self.device_group)

    def send_load(self, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """Broadcasts whole-head KV blocks to write (ids [n] int64, data uint8 [n, bytes],
        both on the driver's device) between steps."""
        dist.broadcast(StepHeader.load_kv().to_tensor(), DRIVER, group=self.ctx.host_group)
        sizes = torch.tensor(data.shape, dtype=torch.int64)
        dist.broadcast(sizes, DRIVER, group=self.ctx.host_group)
        dist.broadcast(block_ids, DRIVER, group=self.device_group)
        dist.broadcast(data, DRIVER, group=self.device_group)

    def send_stop(self) -> None:
        """Tells every worker of the stage to leave its loop (each passes it down the pipe)."""
        dist.broadcast(StepHeader.stop().to_tensor(), DRIVER, group=self.ctx.stage_host_group)

    def receive(self) -> ReceivedStep | ReceivedLoad | None:
        """Gives the next step or KV load (a worker blocks here while the server is idle);
        None: stop."""
        values = StepHeader.empty_tensor()
        dist.broadcast(values, DRIVER, group=self.ctx.stage_host_group)
        header = StepHeader.from_tensor(values)
        if header.command == STOP:
            return None
        device = self.ctx.device
        if header.command == LOAD_KV:
            sizes = torch.empty(2, dtype=torch.int64)
            dist.broadcast(sizes, DRIVER, group=self.ctx.host_group)
            count, size = sizes.tolist()
            block_ids = torch.empty(count, dtype=torch.int64, device=device)
            data = torch.empty((count, size), dtype=torch.uint8, device=device)
            dist.broadcast(block_ids, DRIVER, group=self.device_group)
            dist.broadcast(data, DRIVER, group=self.device_group)
            return ReceivedLoad(block_ids, data)
        buf = torch.empty(buffer_size(header), dtype=torch.int64, device=device)
        dist.broadcast(buf, DRIVER, group=self.device_group)
        prev_tokens = None
        if header.num_patched:
            prev_tokens = torch.empty(header.num_prev_tokens, dtype=torch.int64, device=device)
            dist.broadcast(prev_tokens, DRIVER, group=self.device_group)
        host = buf.numpy() if device.type == "cpu" else None
        return ReceivedStep(header, buf, host, prev_tokens)
