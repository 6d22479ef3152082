"""The device memory a `--kv-transport nixl` engine keeps beside its KV cache.

NIXL moves KV GPU to GPU only between buffers registered with it: a prefill
engine packs a pull's blocks into a registered send region, a decode engine
READs them into a landing pool on its device (`kv_transfer.nixl_region`,
`kv_connector.host_tier`). Both come out of what `--gpu-memory-utilization`
grants, before the KV cache is sized, so the engine stays within it.
"""

from __future__ import annotations

from kvpilot.engine.contracts.args import EngineArgs

GIB = 2**30
# a prefill engine's send region, at most: two 8k-token prompts of a Llama-3-8B shape (bf16)
SEND_REGION_BYTES = 2 * GIB
# a decode engine's landing pool on its GPU, at most: four such prompts
LANDING_BYTES = 4 * GIB


def nixl_device_bytes(args: EngineArgs) -> int:
    """Gives the device bytes `args`' NIXL buffers take at most (0 without NIXL, and for a
    decode engine with a host tier, whose pulls land in host memory)."""
    if args.kv_transport != "nixl":
        return 0
    if args.role == "prefill":
        return SEND_REGION_BYTES
    if args.role == "decode" and args.kv_offload_gb <= 0:
        return LANDING_BYTES
    return 0
