"""Lease bookkeeping and the frame codec: tables plus property tests of their invariants."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.engine.contracts import kv_protocol as protocol
from kvpilot.engine.contracts.kv_protocol import Frame
from kvpilot.engine.kv_transfer.leases import LeaseTable


@pytest.mark.parametrize(("events", "live_at_end", "unpinned"), [
    # (time, action, lease id); leases last 10 s
    ([(0, "open", "a"), (5, "release", "a")], [], ["a"]),
    ([(0, "open", "a"), (10, "expire", None)], [], ["a"]),
    ([(0, "open", "a"), (9.9, "expire", None)], ["a"], []),
    ([(0, "open", "a"), (1, "open", "a")], ["a"], ["a"]),  # re-offer replaces, old one unpinned
    ([(0, "open", "a"), (10, "expire", None), (11, "release", "a")], [], ["a"]),  # only once
    ([(0, "open", "a"), (5, "open", "b"), (12, "expire", None)], ["b"], ["a"]),
])
def test_lease_table(events, live_at_end, unpinned):
    table: LeaseTable[str] = LeaseTable(10)
    freed: list[str] = []
    now = 0.0
    for now, action, lease_id in events:
        if action == "open":
            old = table.open(lease_id, [1], lease_id, now)
            freed += [old.pinned] if old else []
        elif action == "release":
            lease = table.release(lease_id)
            freed += [lease.pinned] if lease else []
        else:
            freed += [lease.pinned for lease in table.expire(now)]
    assert sorted(i for i in "ab" if table.get(i, now)) == live_at_end
    assert freed == unpinned


def test_lease_seconds_must_be_positive():
    with pytest.raises(ValueError, match="lease_seconds=0 is invalid"):
        LeaseTable(0)


@given(st.lists(st.tuples(st.sampled_from(["open", "release", "expire"]),
                          st.sampled_from("abc"), st.floats(0, 5)), max_size=40))
def test_every_pin_is_released_exactly_once(actions):
    table: LeaseTable[int] = LeaseTable(2)
    pins: dict[int, int] = {}
    serial, now = 0, 0.0
    for action, lease_id, dt in actions:
        now += dt
        if action == "open":
            serial += 1
            pins[serial] = 1
            old = table.open(lease_id, [serial], serial, now)
            if old:
                pins[old.pinned] -= 1
        elif action == "release":
            lease = table.release(lease_id)
            if lease:
                pins[lease.pinned] -= 1
        else:
            for lease in table.expire(now):
                pins[lease.pinned] -= 1
    for lease in table.expire(float("inf")):
        pins[lease.pinned] -= 1
    assert all(count == 0 for count in pins.values())


def read(raw: bytes) -> tuple[Frame, bytes]:
    async def go() -> tuple[Frame, bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        return await protocol.read_frame(reader)
    return asyncio.run(go())


@given(st.sampled_from([f for f in Frame if f is not Frame.BLOCK]),
       st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=4))
def test_control_frames_round_trip(kind, message):
    frame, payload = read(protocol.encode(kind, message))
    assert frame is kind
    assert json.loads(payload) == message


@given(st.integers(0, 2**64 - 1), st.binary(max_size=4096))
def test_block_frames_round_trip(block_hash, data):
    frame, payload = read(b"".join(bytes(b) for b in protocol.encode_block(block_hash, data)))
    assert frame is Frame.BLOCK
    got_hash, got_data = protocol.decode_block(payload)
    assert (got_hash, bytes(got_data)) == (block_hash, data)
