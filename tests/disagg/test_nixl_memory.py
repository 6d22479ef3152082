"""The device bytes a NIXL engine's buffers take come out of the KV cache's budget."""

from __future__ import annotations

import pytest

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.nixl_memory import LANDING_BYTES, SEND_REGION_BYTES, nixl_device_bytes


@pytest.mark.parametrize(("flags", "reserved"), [
    ({"role": "prefill", "kv_transport": "nixl"}, SEND_REGION_BYTES),
    ({"role": "decode", "kv_transport": "nixl"}, LANDING_BYTES),
    ({"role": "decode", "kv_transport": "nixl", "kv_offload_gb": 1.0}, 0),  # lands in host memory
    ({"role": "prefill", "kv_transport": "tcp"}, 0),
    ({"role": "decode", "kv_transport": "tcp"}, 0),
    ({}, 0),
])
def test_nixl_buffers_reserved_per_role(flags: dict, reserved: int) -> None:
    assert nixl_device_bytes(EngineArgs(model="tiny-llama", **flags)) == reserved
