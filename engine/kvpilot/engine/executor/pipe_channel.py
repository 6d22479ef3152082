"""How a step travels down the pipeline: each rank of stage s sends the step (header,
packed buffer) and its activations (hidden states, residual) to the rank of the same
tensor-parallel rank in stage s + 1; the last stage's first rank sends the logits rows
back to the driver.

Sends are asynchronous (`isend`): a stage hands its batch on and starts the next one
while the stage after it still computes, which is what lets batches overlap. Headers go
over the host group (gloo, which waits as long as a server idles); the buffers over the
device group (NCCL on CUDA). Every pair sends and receives in the same order, so
messages match without any per-step negotiation.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from kvpilot.engine.executor.step_channel import DRIVER
from kvpilot.engine.parallel.distributed import RankContext
from kvpilot.engine.parallel.stage import Intermediate
from kvpilot.engine.worker.step_batch import STOP, StepHeader, buffer_size

# sends kept in flight before the oldest is waited for (each holds its tensors alive)
MAX_PENDING_SENDS = 16


class PipeChannel:
    """One rank's sends to the next stage and receives from the previous one."""

    def __init__(self, ctx: RankContext, hidden_size: int, dtype: torch.dtype) -> None:
        self.ctx = ctx
        tp_size = ctx.tp.size
        self.next = ctx.rank + tp_size if not ctx.stage.is_last else None
        self.prev = ctx.rank - tp_size if not ctx.stage.is_first else None
        self.hidden_size, self.dtype = hidden_size, dtype
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()
        self.last_rank = (ctx.stage.size - 1) * tp_size  # sends the logits to the driver

    def _isend(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None) -> None:
        work = dist.isend(tensor, dst, group=group)
        assert work is not None  # this rank is a member of `group`
        self._pending.append((work, tensor))
        while len(self._pending) > MAX_PENDING_SENDS:
            self._pending.popleft()[0].wait()

    def send_next(self, header: StepHeader, buf: torch.Tensor, out: Intermediate) -> None:
        """Hands one step and this stage's activations to the next stage."""
        assert self.next is not None  # the last stage sends logits, not activations
        self._isend(header.to_tensor(), self.next, self.ctx.host_group)
        self._isend(buf, self.next, None)
        self._isend(out.hidden.contiguous(), self.next, None)
        self._isend(out.residual.contiguous(), self.next, None)

    def send_stop_next(self) -> None:
        """Tells the next stage to leave its loop (it passes the stop on)."""
        if self.next is not None:
            self._isend(StepHeader.stop().to_tensor(), self.next, self.ctx.host_group)

    def receive(self) -> tuple[StepHeader, torch.Tensor, np.ndarray | None, Intermediate] | None:
        """Gives the next step from the previous stage (header, buffer, its host memory on
        CPU, the activations); None: stop. Blocks while the server is idle."""
        assert self.prev is not None  # the first stage gets its steps from the driver
        values = StepHeader.empty_tensor()
        dist.recv(values, self.prev, group=self.ctx.host_group)
        header = StepHeader.from_tensor(values)
        if header.command == STOP:
            return None
        device = self.ctx.device
        buf = torch.empty(buffer_size(header), dtype=torch.int64, device=device)
        dist.recv(buf, self.prev)
        shape = (header.num_tokens, self.hidden_size)
        hidden = torch.empty(shape, dtype=self.dtype, device=device)
        residual = torch.empty(shape, dtype=self.dtype, device=device)
        dist.recv(hidden, self.prev)
        dist.recv(residual, self.prev)
        host = buf.numpy() if device.type == "cpu" else None
        return header, buf, host, Intermediate(hidden, residual)

    def send_logits(self, logits: torch.Tensor) -> None:
        """Sends the last stage's gathered logits rows to the driver (its first rank only)."""
        self._isend(logits.contiguous(), DRIVER, self.ctx.logits_group)

    def receive_logits(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """Gives the driver the next step's logits rows (model dtype) from the last stage."""
        logits = torch.empty((num_rows, vocab_size), dtype=self.dtype,
                             device=self.ctx.device)
        dist.recv(logits, self.last_rank, group=self.ctx.logits_group)
        return logits

    def flush(self) -> None:
        """Waits until every send has gone out."""
        while self._pending:
            self._pending.popleft()[0].wait()
