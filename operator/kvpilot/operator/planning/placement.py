"""What planning decided for one pool's pods, in the shape the pod renderer needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.api.accelerator import AcceleratorSpec
from kvpilot.operator.api.common import CommunicationSpec, EngineSpec, ModelSource, TopologySpec
from kvpilot.operator.planning import comm, topology


@dataclass(frozen=True)
class PodPlacement:
    """Where and on what one engine pod runs."""

    gpu_resource: str | None
    """Extended resource of the GPUs (nvidia.com/gpu, amd.com/gpu, amd.com/cpx_nps4); None on CPU."""
    gpus_per_pod: int
    """GPUs one pod requests (all of a replica's, or one node's share of them)."""
    nodes_per_replica: int = 1
    """Pods of one replica; above 1 the replica is a leader/worker group."""
    node_selector_terms: list[list[dict[str, Any]]] = field(default_factory=list)
    """Required node affinity: a node matches all expressions of any one term."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Tolerations of the vendor's GPU taints."""
    env: dict[str, str] = field(default_factory=dict)
    """NCCL/RCCL environment (user overrides already applied)."""
    rdma: bool = False
    """Ask for IPC_LOCK and an RDMA device."""

    @property
    def shm_size(self) -> str:
        """Gives the /dev/shm size: NCCL's shared-memory transport wants a few GiB per GPU."""
        if not self.gpu_resource:
            return "1Gi"
        return f"{max(8, 4 * self.gpus_per_pod)}Gi"


def plan_placement(topo: TopologySpec, model: ModelSource, accelerator: AcceleratorSpec,
                   engine: EngineSpec, communication: CommunicationSpec) -> PodPlacement:
    """Gives the pods' placement of a pool's sections; raises ValueError naming the field when
    the topology or the accelerator cannot run the model."""
    plan = topology.plan(topo, model, accelerator, engine)
    where = plan.placement
    return PodPlacement(
        gpu_resource=where.resource_name,
        gpus_per_pod=plan.gpus_per_pod,
        nodes_per_replica=plan.nodes_per_replica,
        node_selector_terms=[list(term) for term in where.node_selector_terms],
        tolerations=[dict(t) for t in where.tolerations],
        env=comm.nccl_env(accelerator, plan, communication),
        rdma=comm.needs_ipc_lock(communication),
    )
