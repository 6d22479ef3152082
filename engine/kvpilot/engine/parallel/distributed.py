"""Joins a rank to its engine's process groups: the device group the model's collectives
use (NCCL on CUDA, RCCL through the same API on ROCm, gloo on CPU) and a gloo group on
the host for step headers and start-up agreement. With pipeline parallelism each stage
gets its own pair of them (its TP ranks), and the driver and the last stage's first rank
a device group of two for the logits coming back (its own communicator, so on NCCL the
logits never queue behind the driver's activation sends to the same peer).

Timeouts: a collective inside a step that waits `COLLECTIVE_TIMEOUT` has lost a
rank; workers wait on the host group for the next step, which may come after hours
of an idle server, so that group waits `IDLE_TIMEOUT`. A rank that dies is noticed
sooner than either: its sockets close (gloo raises at once) and the driver's
watchdog sees the process exit (`parallel.processes`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvpilot.engine.contracts.rendezvous import Rendezvous
from kvpilot.engine.parallel.config import ParallelConfig
from kvpilot.engine.parallel.groups import TPGroup
from kvpilot.engine.parallel.stage import PipelineStage

logger = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
IDLE_TIMEOUT = timedelta(days=30)


@dataclass(frozen=True)
class RankContext:
    """One rank's place in the engine: its device, its stage, its TP group, the host groups."""

    rank: int
    world_size: int
    device: torch.device
    tp: TPGroup
    host_group: dist.ProcessGroup  # gloo, every rank: start-up agreement, stage-to-stage headers
    stage: PipelineStage
    stage_host_group: dist.ProcessGroup  # gloo, this stage's TP ranks: step headers
    # device group of the driver and the last stage's first rank (pipeline parallelism only)
    logits_group: dist.ProcessGroup | None = None

    def min_over_ranks(self, value: int) -> int:
        """Gives the smallest `value` any rank holds (every rank calls it)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())


def init_method(rendezvous: Rendezvous) -> str:
    """Gives the TCP store address rank 0 listens on and the others join."""
    host = rendezvous.master_addr
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    return f"tcp://{host}:{rendezvous.master_port}"


def init_distributed(parallel: ParallelConfig, rendezvous: Rendezvous, rank: int,
                     device_type: str, num_layers: int) -> RankContext:
    """Gives rank `rank`'s context once every rank of the world has joined."""
    local_rank = rank - rendezvous.local_ranks.start
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=init_method(rendezvous), rank=rank,
                            world_size=rendezvous.world_size, timeout=COLLECTIVE_TIMEOUT)
    host_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    world = dist.group.WORLD
    # every rank is a member of both (new_group gives an int sentinel only to non-members)
    assert isinstance(host_group, dist.ProcessGroup) and world is not None
    pp_rank, tp_rank = parallel.coordinates(rank)
    pp_size, tp_size = parallel.pipeline_parallel_size, parallel.tensor_parallel_size
    stage = PipelineStage.of(num_layers, pp_size, pp_rank)
    if pp_size == 1:  # one stage: the TP group is the whole world
        tp = TPGroup(tp_rank, tp_size, parallel.expert_parallel_size, world)
        return RankContext(rank, rendezvous.world_size, device, tp, host_group, stage, host_group)
    # every rank creates every group, in the same order (torch.distributed requires it)
    stage_groups = []
    for first in range(0, parallel.world_size, tp_size):
        ranks = list(range(first, first + tp_size))
        stage_groups.append((dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT),
                             dist.new_group(ranks, backend="gloo", timeout=IDLE_TIMEOUT)))
    logits_group = dist.new_group([0, (pp_size - 1) * tp_size], timeout=COLLECTIVE_TIMEOUT)
    device_group, stage_host = stage_groups[pp_rank]
    assert isinstance(device_group, dist.ProcessGroup)  # this rank is in its stage's groups
    assert isinstance(stage_host, dist.ProcessGroup)
    tp = TPGroup(tp_rank, tp_size, parallel.expert_parallel_size, device_group)
    return RankContext(rank, rendezvous.world_size, device, tp, host_group, stage, stage_host,
                       logits_group if isinstance(logits_group, dist.ProcessGroup) else None)


def destroy_distributed(wait_s: float = 60.0) -> None:
    """Leaves the process groups (so a later engine in this process can join new ones).

    Every rank leaves at the same time: NCCL's destroy finalizes each communicator with
    its peers, so a rank that leaves after its peers have exited waits forever (seen on
    4 H100s, with destroy and with abort alike). The driver therefore leaves right after
    sending the stop step, while its workers leave too. After a failure a peer may be
    gone: the leaving happens in a thread, and after `wait_s` seconds the rank gives up
    (logged) rather than hang its shutdown.
    """
    if not dist.is_initialized():
        return
    leave = threading.Thread(target=dist.destroy_process_group, name="kvpilot-leave-groups",
                             daemon=True)
    leave.start()
    leave.join(wait_s)
    if leave.is_alive():
        logger.warning("left the process groups unfinished after %.0f s (a peer is gone); "
                       "a new engine in this process cannot join new groups", wait_s)
