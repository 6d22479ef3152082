"""The NIXL agent and its pure parts: descriptor lists for block slices, the layout and SLOTS
messages a peer sends, a READ from another process, a killed peer (a clear error, fast),
and a READ that never finishes (a bounded wait, its buffer kept out of the pool)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch
from nixl_peer_process import serve_cache

from kvpilot.engine.contracts.kv_protocol import HEADER, ProtocolError
from kvpilot.engine.kv_transfer.nixl_agent import (
    NixlAgent,
    NixlError,
    NixlTimeout,
    NixlUnavailable,
    nixl_api,
)
from kvpilot.engine.kv_transfer.nixl_layout import (
    CacheLayout,
    read_descriptors,
    region_descriptors,
)
from kvpilot.engine.kv_transfer.nixl_pull import Source, land_in_place, parse_slots, slots_frame
from kvpilot.engine.kv_transfer.nixl_region import SendRegion

LAYOUT = CacheLayout("VRAM", 1, (1000, 5000), num_blocks=10, piece_bytes=8)


def test_descriptors_read_each_layer_and_kv_piece_into_its_row_offset():
    local, remote = read_descriptors(LAYOUT, [3, 7], [100, 200])
    # rows are [layer0 K, layer0 V, layer1 K, layer1 V], 8 bytes each
    assert local.tolist() == [[100, 8, 0], [108, 8, 0], [116, 8, 0], [124, 8, 0],
                              [200, 8, 0], [208, 8, 0], [216, 8, 0], [224, 8, 0]]
    # cache l at ptr_l: K of block b at ptr_l + b*8, V at ptr_l + (10 + b)*8; device 1
    assert remote.tolist() == [[1024, 8, 1], [1104, 8, 1], [5024, 8, 1], [5104, 8, 1],
                               [1056, 8, 1], [1136, 8, 1], [5056, 8, 1], [5136, 8, 1]]
    assert local.dtype == remote.dtype == np.uint64
    assert LAYOUT.block_bytes == 32


@pytest.mark.parametrize(("block_ids", "rows", "error"), [
    ([10], [0], ProtocolError),  # past the peer's cache
    ([-1], [0], ProtocolError),
    ([1, 2], [0], ValueError),  # one row for two blocks
])
def test_descriptors_refuse_bad_block_ids(block_ids, rows, error):
    with pytest.raises(error):
        read_descriptors(LAYOUT, block_ids, rows)


@pytest.mark.parametrize(("change", "names"), [
    ({"mem": "HBM"}, "mem='HBM'"),
    ({"cache_ptrs": []}, "empty"),
    ({"num_blocks": "many"}, "malformed"),
    ({"piece_bytes": None}, "malformed"),
])
def test_layout_message_refuses_bad_fields(change, names):
    assert CacheLayout.from_message(LAYOUT.to_message()) == LAYOUT
    with pytest.raises(ProtocolError, match=names):
        CacheLayout.from_message({**LAYOUT.to_message(), **change})


REGION = CacheLayout("VRAM", 1, (1000, 5000), num_blocks=10, piece_bytes=8,
                     region_ptr=9000, region_rows=6)


def test_region_descriptors_merge_runs_of_consecutive_rows():
    # remote rows 0,1,2 -> local 5,6,9: one run (0-1 -> 5-6), then 2 -> 9 alone
    local, remote = region_descriptors(REGION, [0, 1, 2], 100, [5, 6, 9], local_device=0)
    assert local.tolist() == [[100 + 5 * 32, 64, 0], [100 + 9 * 32, 32, 0]]
    assert remote.tolist() == [[9000, 64, 1], [9000 + 2 * 32, 32, 1]]
    with pytest.raises(ProtocolError, match="outside its 6-row send region"):
        region_descriptors(REGION, [6], 100, [0])
    assert CacheLayout.from_message(REGION.to_message()) == REGION


def test_send_region_takes_first_fit_runs_and_merges_what_comes_back():
    region = SendRegion(torch.zeros((8, 4), dtype=torch.uint8))
    assert [region.take(3), region.take(3)] == [0, 3]
    assert region.take(3, wait_s=0.01) is None  # 2 rows left
    assert region.take(9) is None  # more rows than the region has: no wait
    region.give(0, 3)
    assert region.take(2) == 0
    region.give(3, 3)
    region.give(0, 2)
    assert region.free_rows == 8 and region.take(8) == 0


def test_slots_round_trip_and_refuse_a_wrong_count():
    payload = slots_frame([4, 9], [b"\x01" * 8, b"\x02" * 8])
    message = json.loads(payload[HEADER.size:])
    assert parse_slots(message, 2) == ([4, 9], [b"\x01" * 8, b"\x02" * 8], None)
    with pytest.raises(ProtocolError, match="for 3 wanted blocks"):
        parse_slots(message, 3)
    packed = json.loads(slots_frame([4, 9], [b"\x01" * 8] * 2, region_row=3)[HEADER.size:])
    assert parse_slots(packed, 2)[2] == 3


class _StuckAgent:
    """A nixl agent whose READs never finish."""

    backends: ClassVar[dict[str, object]] = {"UCX": object()}
    released = 0

    def __init__(self, *args) -> None:
        pass

    def register_memory(self, descs, mem):
        return descs

    def get_xfer_descs(self, descs, mem):
        return descs

    def initialize_xfer(self, *args):
        return "handle"

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        return "PROC"

    def release_xfer_handle(self, handle):
        _StuckAgent.released += 1


def test_a_read_that_never_finishes_times_out_and_keeps_its_handle():
    api = SimpleNamespace(nixl_agent=_StuckAgent, nixl_agent_config=lambda *a, **k: None)
    agent = NixlAgent("stuck", api=api)  # type: ignore[arg-type]
    rows = torch.zeros((2, LAYOUT.block_bytes), dtype=torch.uint8)
    started = time.monotonic()
    with pytest.raises(NixlTimeout, match=r"ran past its 0\.3 s"):
        agent.read("peer", LAYOUT, [1, 2], rows, timeout=0.3)
    assert time.monotonic() - started < 5
    assert _StuckAgent.released == 0  # still running: releasing it could free a live request


def _importable() -> bool:
    try:
        nixl_api()
    except NixlUnavailable:
        return False
    return True


needs_nixl = pytest.mark.skipif(not _importable(), reason="nixl is not installed; "
                                "pip install 'kvpilot-engine[nixl]'")


@pytest.fixture
def peer():
    """A NIXL peer process with 2 layer caches of 16 blocks (pieces of 4 KiB); killed after."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=serve_cache, args=(theirs, 2, 16, 4096), daemon=True)
    process.start()
    assert ours.poll(60), "the peer process sent no offer"
    offer, caches = ours.recv()
    yield process, offer, caches
    process.kill()
    process.join(10)


@needs_nixl
def test_read_from_another_process_gives_wire_layout_rows(peer):
    _, offer, caches = peer
    agent = NixlAgent("reader")
    try:
        name, layout = agent.connect(offer)
        assert name == "peer-process" and layout.mem == "DRAM"
        rows = torch.zeros((3, layout.block_bytes), dtype=torch.uint8)
        agent.read(name, layout, [5, 0, 15], rows, timeout=20)
        views = [np.frombuffer(c, np.uint8).reshape(2, 16, 4096) for c in caches]
        for row, block in zip(rows.numpy(), [5, 0, 15], strict=True):
            expected = np.concatenate([views[layer][kv, block] for layer in range(2)
                                       for kv in range(2)])
            assert np.array_equal(row, expected)
    finally:
        agent.close()


@needs_nixl
def test_read_rows_from_another_process_gives_its_send_region_rows(peer):
    _, offer, _ = peer
    agent = NixlAgent("region-reader")
    try:
        name, layout = agent.connect(offer)
        assert layout.region_rows == 4
        rows = torch.zeros((4, layout.block_bytes), dtype=torch.uint8)
        agent.read_rows(name, layout, [2, 3, 0], rows, timeout=20, at=[0, 1, 3])
        # region row r holds r + 1 in every byte; local row 2 is not written
        assert [int(rows[i, 0]) for i in range(4)] == [3, 4, 0, 1]
        assert bool((rows[1] == 4).all())
    finally:
        agent.close()


@needs_nixl
def test_read_from_a_killed_peer_is_a_clear_error_not_a_hang(peer):
    process, offer, _ = peer
    agent = NixlAgent("reader-of-dead")
    try:
        name, layout = agent.connect(offer)
        rows = torch.zeros((4, layout.block_bytes), dtype=torch.uint8)
        agent.read(name, layout, [0, 1, 2, 3], rows, timeout=20)
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        started = time.monotonic()
        with pytest.raises(NixlError, match="peer-process"):
            agent.read(name, layout, [0, 1, 2, 3], rows, timeout=20)
        assert time.monotonic() - started < 20
    finally:
        agent.close()


class _FakeLanding:
    """A DirectLanding store with rows 10, 11, ... for the hashes it does not hold."""

    def __init__(self, held: set[int]) -> None:
        self.held, self.landed, self.abandoned = held, [], []

    def reserve(self, hashes):
        entries = [(h, 10 + i) for i, h in enumerate(h for h in hashes if h not in self.held)]
        return torch.zeros((16, 8), dtype=torch.uint8), entries

    def land(self, entries, digests):
        self.landed.append((entries, digests))

    def abandon(self, entries):
        self.abandoned.append(entries)


class _ReadAgent:
    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.calls = error, []

    def read(self, peer, layout, block_ids, rows, timeout, at=None):
        self.calls.append(("cache", block_ids, at))
        if self.error is not None:
            raise self.error

    def read_rows(self, peer, layout, region_rows, rows, timeout, at=None):
        self.calls.append(("region", region_rows, at))
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize(("error", "landed", "abandoned"), [
    (None, True, False),  # read, then findable with the SLOTS checksums
    (NixlError("peer gone"), False, True),  # rows back to the pool
    (NixlTimeout("still running"), False, False),  # rows kept reserved: the peer may write
])
@pytest.mark.parametrize("region_row", [None, 4])
def test_land_in_place_reads_only_missing_blocks_once(error, landed, abandoned, region_row):
    store, agent = _FakeLanding(held={2}), _ReadAgent(error)
    digests = [bytes([i]) * 8 for i in range(3)]
    source = Source(agent, "peer", LAYOUT, [7, 8, 9], region_row)  # type: ignore[arg-type]

    def call() -> int:
        return land_in_place(source, store, [1, 2, 3], digests, lambda: 5.0)

    if error is None:
        assert call() == 2
    else:
        with pytest.raises(type(error)):
            call()
    # one READ: remote blocks 7 and 9, or region rows 4 and 6 (hash 2 is held), into host
    # rows 10 and 11
    assert agent.calls == ([("cache", [7, 9], [10, 11])] if region_row is None else
                           [("region", [4, 6], [10, 11])])
    assert bool(store.landed) is landed and bool(store.abandoned) is abandoned
    if landed:
        assert store.landed == [([(1, 10), (3, 11)], [digests[0], digests[2]])]
