"""Imports blocks into a block store the way the decode agent does, without a socket."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpilot.engine.contracts.kv_protocol import checksum
from kvpilot.engine.kv_transfer.tcp import import_group


def import_data(store, hashes: list[int], datas: Iterable, prefix: Sequence[int] = ()) -> int:
    """Imports blocks a receive buffer-full at a time through the agent's `import_group`
    (each block checked against its data's checksum); gives how many went in."""
    datas, imported = list(datas), 0
    buffer = store.receive_buffer(5)
    try:
        for start in range(0, len(hashes), buffer.capacity):
            group = hashes[start:start + buffer.capacity]
            data = datas[start:start + len(group)]
            for index, block in enumerate(data):
                buffer.block(index)[:] = block
            count, _, staged = import_group(store, buffer, group, [checksum(b) for b in data],
                                            [*prefix, *hashes[:start]])
            imported += count
            staged.wait()
    finally:
        buffer.release()
    return imported
