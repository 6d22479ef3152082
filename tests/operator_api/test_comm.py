"""NCCL/RCCL env: documented defaults per vendor and topology; the user's settings win."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.operator.api import AcceleratorSpec, CommunicationSpec, ModelSource, TopologySpec
from kvpilot.operator.planning.comm import nccl_env, needs_ipc_lock
from kvpilot.operator.planning.topology import plan

TINY = ModelSource(name="tiny", source="dummy:tiny-llama")
MI300X = {"vendor": "amd", "model": "MI300X"}
H100 = {"vendor": "nvidia", "model": "H100-80GB"}


def env_for(acc: dict[str, Any], tp: int = 1, pp: int = 1, **comm: Any) -> dict[str, str]:
    accelerator = AcceleratorSpec.model_validate(acc)
    p = plan(TopologySpec(tensor_parallel=tp, pipeline_parallel=pp), TINY, accelerator)
    return nccl_env(accelerator, p, CommunicationSpec.model_validate(comm))


@pytest.mark.parametrize(("acc", "tp", "pp", "comm", "expected"), [
    (H100, 1, 1, {}, {}),
    (H100, 8, 1, {}, {}),
    (H100, 8, 2, {}, {"NCCL_IB_DISABLE": "1"}),
    (H100, 8, 2, {"rdma": True, "ibHca": "mlx5_0,mlx5_1", "ibGidIndex": 3},
     {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_IB_GID_INDEX": "3"}),
    (H100, 8, 1, {"socketIfname": "eth0", "debug": "INFO", "nvlsEnable": False},
     {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO",
      "NCCL_NVLS_ENABLE": "0"}),
    (MI300X, 1, 1, {}, {}),
    (MI300X, 8, 1, {}, {"NCCL_MIN_NCHANNELS": "112"}),
    (MI300X, 1, 2, {}, {"NCCL_MIN_NCHANNELS": "112"}),
    (MI300X, 8, 1, {"minNchannels": 64}, {"NCCL_MIN_NCHANNELS": "64"}),
    (MI300X, 8, 1, {"env": {"NCCL_MIN_NCHANNELS": "32", "RCCL_MSCCL_ENABLE": "0"}},
     {"NCCL_MIN_NCHANNELS": "32", "RCCL_MSCCL_ENABLE": "0"}),
    (MI300X, 8, 2, {"env": {"NCCL_IB_DISABLE": "0"}},
     {"NCCL_MIN_NCHANNELS": "112", "NCCL_IB_DISABLE": "0"}),
    ({"vendor": "amd", "model": "MI250X"}, 8, 1, {}, {}),
    ({"vendor": "cpu"}, 2, 1, {"debug": "WARN"}, {"NCCL_DEBUG": "WARN"}),
], ids=["h100-single", "h100-tp8", "h100-two-nodes-tcp", "h100-two-nodes-rdma",
        "h100-typed-fields", "mi300x-single", "mi300x-tp8", "mi300x-pp2", "typed-beats-default",
        "env-beats-typed", "env-beats-default", "mi250x-no-channel-default", "cpu"])
def test_env(acc: dict[str, Any], tp: int, pp: int, comm: dict[str, Any],
             expected: dict[str, str]):
    assert env_for(acc, tp, pp, **comm) == expected


@given(env=st.dictionaries(st.sampled_from(["NCCL_DEBUG", "NCCL_MIN_NCHANNELS",
                                            "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "X"]),
                           st.text("abc123", min_size=1, max_size=4)))
def test_user_env_always_wins(env: dict[str, str]):
    got = env_for(MI300X, 8, 2, debug="TRACE", socketIfname="ib0", env=env)
    assert all(got[k] == v for k, v in env.items())
    assert list(got) == sorted(got)


@pytest.mark.parametrize(("rdma", "expected"), [(True, True), (False, False)])
def test_ipc_lock_only_with_rdma(rdma: bool, expected: bool):
    assert needs_ipc_lock(CommunicationSpec(rdma=rdma)) is expected
