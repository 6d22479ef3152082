"""A NIXL agent in its own process that registers a DRAM 'cache' and hands its offer over a
pipe, then waits to be killed (the killed-peer tests' prefill side)."""

from __future__ import annotations

import multiprocessing.connection
import time


def serve_cache(conn: multiprocessing.connection.Connection, layers: int, num_blocks: int,
                piece_bytes: int) -> None:
    """Registers `layers` caches [2, num_blocks, piece_bytes] of known bytes and a send region
    of 4 rows (row r filled with r + 1); sends (offer, caches' bytes); sleeps until killed
    (bounded: 120 s)."""
    import torch

    from kvpilot.engine.kv_transfer.nixl_agent import NixlAgent

    caches = [torch.arange(2 * num_blocks * piece_bytes, dtype=torch.int64)
              .add_(layer).to(torch.uint8).view(2, num_blocks, piece_bytes)
              for layer in range(layers)]
    agent = NixlAgent("peer-process")
    layout = agent.register_caches(caches)
    rows = torch.arange(1, 5, dtype=torch.uint8)[:, None].repeat(1, layout.block_bytes)
    agent.register_region(rows)
    conn.send((agent.offer(), [c.numpy().tobytes() for c in caches]))
    time.sleep(120)
