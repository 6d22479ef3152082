"""NCCL/RCCL environment for engine pods, per vendor and topology; the user's settings win.

Defaults and why (RCCL reads the same NCCL_* variables as NCCL):
- NCCL_MIN_NCHANNELS=112 on AMD MI300-series when a replica spans GPUs: AMD's vLLM
  tuning guide for MI300X recommends it for TP/PP collectives (RCCL's default channel
  count under-uses xGMI).
- NCCL_IB_DISABLE=1 when a replica spans nodes without `rdma: true`: the pod network is
  plain TCP, and letting NCCL probe host IB devices it cannot use fails or hangs.
- Nothing about NVLS (NVLink SHARP): NCCL enables it only where NVSwitch multicast works
  and falls back otherwise; `nvlsEnable: false` turns it off where a driver or fabric
  manager misreports it.
- NCCL_DEBUG, NCCL_SOCKET_IFNAME (mirrored to GLOO_SOCKET_IFNAME, which torch's CPU
  groups use), NCCL_IB_HCA, NCCL_IB_GID_INDEX: only when set in spec.communication.
Order of precedence: defaults < typed fields < communication.env.
"""

from __future__ import annotations

from kvpilot.operator.api.accelerator import AcceleratorSpec
from kvpilot.operator.api.common import CommunicationSpec
from kvpilot.operator.planning.topology import TopologyPlan

MI300_SERIES = ("MI300X", "MI325X")
AMD_MIN_NCHANNELS = 112


def defaults(acc: AcceleratorSpec, plan: TopologyPlan, comm: CommunicationSpec) -> dict[str, str]:
    """Gives the variables kvpilot sets when the user says nothing."""
    env: dict[str, str] = {}
    if acc.vendor == "cpu":
        return env
    spans_gpus = plan.tensor_parallel > 1 or plan.pipeline_parallel > 1
    if acc.vendor == "amd" and spans_gpus and (acc.model or "MI300X") in MI300_SERIES:
        env["NCCL_MIN_NCHANNELS"] = str(AMD_MIN_NCHANNELS)
    if plan.multi_node and not comm.rdma:
        env["NCCL_IB_DISABLE"] = "1"
    return env


def typed(comm: CommunicationSpec) -> dict[str, str]:
    """Gives the variables spelled by spec.communication's typed fields."""
    env: dict[str, str] = {}
    if comm.socket_ifname is not None:
        env["NCCL_SOCKET_IFNAME"] = comm.socket_ifname
        env["GLOO_SOCKET_IFNAME"] = comm.socket_ifname
    if comm.ib_hca is not None:
        env["NCCL_IB_HCA"] = comm.ib_hca
    if comm.ib_gid_index is not None:
        env["NCCL_IB_GID_INDEX"] = str(comm.ib_gid_index)
    if comm.debug is not None:
        env["NCCL_DEBUG"] = comm.debug
    if comm.min_nchannels is not None:
        env["NCCL_MIN_NCHANNELS"] = str(comm.min_nchannels)
    if comm.nvls_enable is not None:
        env["NCCL_NVLS_ENABLE"] = "1" if comm.nvls_enable else "0"
    return env


def nccl_env(acc: AcceleratorSpec, plan: TopologyPlan, comm: CommunicationSpec) -> dict[str, str]:
    """Gives the engine container's collective-communication env, sorted by name."""
    merged = {**defaults(acc, plan, comm), **typed(comm), **comm.env}
    return dict(sorted(merged.items()))


def needs_ipc_lock(comm: CommunicationSpec) -> bool:
    """Gives whether pods need the IPC_LOCK capability (RDMA pins memory)."""
    return comm.rdma
