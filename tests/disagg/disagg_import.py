"""Imports blocks into a block store the way the decode agent does, without a socket."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def import_data(store, hashes: list[int], datas: Iterable, prefix: Sequence[int] = ()) -> int:
    """Imports blocks a receive buffer-full at a time (stage, lock, import, wait for the
    writes); gives how many went in."""
    datas, imported = list(datas), 0
    buffer = store.receive_buffer(5)
    try:
        for start in range(0, len(hashes), buffer.capacity):
            group = hashes[start:start + buffer.capacity]
            for index, data in enumerate(datas[start:start + len(group)]):
                buffer.block(index)[:] = data
            staged = store.stage(buffer, group)
            with store.lock:
                imported += store.import_blocks(staged, [*prefix, *hashes[:start]])
            staged.wait()
    finally:
        buffer.release()
    return imported
