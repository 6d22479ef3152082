"""The rendezvous environment of a multi-node engine group: what the operator renders, what
the engine reads.

Torch-free on purpose: `operator/render/workloads.py` builds a leader/worker group's env
from these names, and the engine parses the same env with `Rendezvous.from_env`, so one
module is the contract (pinned by `tests/parallel/test_rendezvous_contract.py`).

Every pod of a group runs the same `kvpilot serve` command. A pod holds `WORLD_SIZE /
NNODES` ranks (its GPUs); global rank = NODE_RANK * ranks_per_node + local rank. Node rank
0's pod runs the server and the driver (global rank 0); the other pods run workers only.
Rank 0 hosts the TCP store at MASTER_ADDR:MASTER_PORT that the others join.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
WORLD_SIZE = "WORLD_SIZE"
NNODES = "NNODES"
NODE_RANK = "NODE_RANK"
RENDEZVOUS_ENV = (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NNODES, NODE_RANK)
LOCAL_ADDR = "127.0.0.1"


class RendezvousError(ValueError):
    """The group environment is incomplete or disagrees with the engine flags."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one engine meet, and which of them this pod runs."""

    master_addr: str
    master_port: int
    world_size: int
    nnodes: int
    node_rank: int

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """Gives the global ranks this pod (node) runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def is_driver_node(self) -> bool:
        """Gives whether this pod runs global rank 0 (the server and the scheduler)."""
        return self.node_rank == 0

    @classmethod
    def local(cls, world_size: int, port: int) -> Rendezvous:
        """Gives the rendezvous of a world that runs on this machine alone."""
        return cls(LOCAL_ADDR, port, world_size, 1, 0)

    @classmethod
    def from_env(cls, env: Mapping[str, str], world_size: int) -> Rendezvous | None:
        """Gives the group rendezvous the pod's env describes, or None when NODE_RANK is unset
        (a one-node engine, which picks its own local port).

        `world_size` is what the engine flags imply (TP x PP); the env must agree.
        """
        if NODE_RANK not in env:
            return None
        missing = [name for name in RENDEZVOUS_ENV if not env.get(name)]
        if missing:
            raise RendezvousError(
                f"{NODE_RANK}={env.get(NODE_RANK)!r} is set but {', '.join(missing)} is not: a "
                f"multi-node engine group needs all of {', '.join(RENDEZVOUS_ENV)} (the operator "
                "renders them); unset NODE_RANK to run on one node")
        values = {}
        for name in (MASTER_PORT, WORLD_SIZE, NNODES, NODE_RANK):
            try:
                values[name] = int(env[name])
            except ValueError:
                raise RendezvousError(f"{name}={env[name]!r} is not an integer") from None
        rendezvous = cls(env[MASTER_ADDR], values[MASTER_PORT], values[WORLD_SIZE],
                         values[NNODES], values[NODE_RANK])
        rendezvous.check(world_size)
        return rendezvous

    def check(self, world_size: int) -> None:
        """Raises RendezvousError unless this group is consistent with `world_size` ranks."""
        if self.world_size != world_size:
            raise RendezvousError(
                f"{WORLD_SIZE}={self.world_size} in the environment but --tensor-parallel-size x "
                f"--pipeline-parallel-size = {world_size}: render the pods from the same "
                "topology, or fix the flags")
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise RendezvousError(
                f"{NNODES}={self.nnodes} does not divide {WORLD_SIZE}={self.world_size}: every "
                "pod of a group holds the same number of ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise RendezvousError(
                f"{NODE_RANK}={self.node_rank} is outside 0..{self.nnodes - 1} ({NNODES}="
                f"{self.nnodes})")
