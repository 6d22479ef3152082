"""What the router and tools ask a KV agent: PULL a lease, or its STATS; torch-free.

Each request opens its own connection and proves the fleet's secret first (`kv_auth`);
`key` is the fleet secret's `kv_key` (the default: no secret).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvpilot.engine.contracts.fleet_secret import FleetSecret
from kvpilot.engine.contracts.kv_auth import prove_to_agent
from kvpilot.engine.contracts.kv_protocol import Frame, encode, expect

NO_SECRET_KEY = FleetSecret().kv_key


async def request_pull(decode_agent: tuple[str, int], remote: tuple[str, int], lease_id: str,
                       timeout: float, key: bytes = NO_SECRET_KEY) -> dict[str, Any]:
    """Asks a decode agent to pull a lease from a prefill agent; gives its DONE message."""
    return await _ask(decode_agent, Frame.PULL, {"remote": f"{remote[0]}:{remote[1]}",
                                                 "lease_id": lease_id, "timeout": timeout},
                      Frame.DONE, timeout, key)


async def request_stats(agent: tuple[str, int], timeout: float = 5.0,
                        key: bytes = NO_SECRET_KEY) -> dict[str, Any]:
    """Gives an agent's lease and block counts (STATS)."""
    return await _ask(agent, Frame.STATS, {}, Frame.STATS, timeout, key)


async def _ask(agent: tuple[str, int], kind: Frame, message: dict[str, Any], reply: Frame,
               timeout: float, key: bytes) -> dict[str, Any]:
    """Gives the agent's `reply` to one control frame, each step bounded by `timeout`."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*agent), timeout)
    try:
        await asyncio.wait_for(prove_to_agent(reader, writer, key), timeout)
        writer.write(encode(kind, message))
        await writer.drain()
        _, answer = await asyncio.wait_for(expect(reader, reply), timeout)
        return answer
    finally:
        writer.close()
