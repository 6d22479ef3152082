"""Joins a rank to its engine's process groups: the device group the model's collectives
use (NCCL on CUDA, RCCL through the same API on ROCm, gloo on CPU) and a gloo group on
the host for step headers and start-up agreement.

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

logger = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
IDLE_TIMEOUT = timedelta(days=30)


@dataclass(frozen=True)
class RankContext:
    """One rank's place in the engine: its device, its TP group, the host group."""

    rank: int
    world_size: int
    device: torch.device
    tp: TPGroup
    host_group: dist.ProcessGroup  # gloo: step headers, start-up agreement

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
                     device_type: str) -> RankContext:
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
    # one pipeline stage (config.validate refuses more): the TP group is the whole world
    _, tp_rank = parallel.coordinates(rank)
    tp = TPGroup(tp_rank, parallel.tensor_parallel_size, parallel.expert_parallel_size, world)
    return RankContext(rank, rendezvous.world_size, device, tp, host_group)


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
    left = threading.Event()

    def leave() -> None:
        dist.destroy_process_group()
        left.set()

    threading.Thread(target=leave, name="kvpilot-leave-groups", daemon=True).start()
    if not left.wait(wait_s):
        logger.warning("left the process groups unfinished after %.0f s (a peer is gone); "
                       "a new engine in this process cannot join new groups", wait_s)
