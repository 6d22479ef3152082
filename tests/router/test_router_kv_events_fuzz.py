"""POST /kv_events under random and mutated batches (hypothesis): never a 5xx, never a hang,
nothing reaches the prefix index without the fleet's signature, a signed batch changes it
exactly as one valid event would, and the router keeps serving throughout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from kvpilot.engine.contracts.fleet_secret import FLEET_AUTH_HEADER, FleetSecret
from kvpilot.engine.contracts.router_args import RouterArgs
from kvpilot.engine.router.app import build_app
from kvpilot.engine.router.kv_events import parse_event
from kvpilot.engine.router.prefix_index import PrefixIndex

SECRET = FleetSecret(b"\x05" * 32)
OTHER = FleetSecret(b"\x06" * 32)
# port 9 (discard): the router's health checks fail fast; the index does not care
INSTANCES = ("http://127.0.0.1:9/a", "http://127.0.0.1:9/b")
MAX_ENTRIES = 64  # small, so random batches reach the index's cap too
EXAMPLES = 150


class CharTokenizer:
    """One token per character: the router keeps a prefix index only with a tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory):
    secret_file = Path(tmp_path_factory.mktemp("fleet")) / "secret"
    secret_file.write_text(SECRET.secret.hex())
    args = RouterArgs(instances=",".join(f"both={url}" for url in INSTANCES), block_size=4,
                      refresh_interval=30.0, fleet_secret_file=str(secret_file),
                      prefix_index_max_entries=MAX_ENTRIES)
    app = build_app(args, tokenizer=CharTokenizer())
    with TestClient(app) as client:
        yield client, app.state.router.index


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
valid_hashes = st.integers(0, 2**64 - 1) | st.integers(0, 40)  # small ones collide
hashes = st.one_of(valid_hashes, st.integers(-2**70, -1), st.integers(2**64, 2**70),
                   st.floats(), st.booleans(), st.text(max_size=4), st.none())
hash_lists = st.lists(valid_hashes, max_size=24) | st.lists(hashes, max_size=4) | json_values
events = st.fixed_dictionaries({}, optional={
    "instance": st.sampled_from([*INSTANCES, INSTANCES[0] + "/", "", "http://elsewhere:1"])
    | st.text(max_size=20),
    "stored": hash_lists,
    "removed": hash_lists,
    "cleared": st.booleans() | json_values,
    "tier": st.sampled_from(["gpu", "host"]) | st.sampled_from(["disk", ""]) | json_values,
    "unknown": json_values,
})
valid_events = st.fixed_dictionaries({"instance": st.sampled_from(INSTANCES)}, optional={
    "stored": st.lists(valid_hashes, max_size=24), "removed": st.lists(valid_hashes, max_size=8),
    "cleared": st.booleans(), "tier": st.sampled_from(["gpu", "host"])})


@st.composite
def mutated_events(draw: st.DrawFn) -> dict:
    """Gives a valid event with one mutation: a key's value replaced, a key added, or one
    bad hash slipped into a list of good ones."""
    event: dict[str, Any] = draw(valid_events)
    key = draw(st.sampled_from(["instance", "stored", "removed", "cleared", "tier", "extra"]))
    if key in ("stored", "removed") and draw(st.booleans()):
        good: list[Any] = list(event.get(key, []))
        at = draw(st.integers(0, len(good)))
        event[key] = [*good[:at], draw(hashes), *good[at:]]
    else:
        event[key] = draw(json_values)
    return event


bodies = st.one_of(valid_events.map(lambda e: json.dumps(e).encode()),
                   mutated_events().map(lambda e: json.dumps(e).encode()),
                   events.map(lambda e: json.dumps(e).encode()),
                   json_values.map(lambda v: json.dumps(v).encode()),
                   st.binary(max_size=256))
# how the batch is signed: by the fleet (most), by another fleet, over other bytes, or not
signings = st.sampled_from(["fleet", "fleet", "fleet", "other-fleet", "other-body", "none"])


def entries(index: PrefixIndex) -> tuple[int, ...]:
    return (len(index), *(index.size(url) for url in INSTANCES))


@settings(max_examples=EXAMPLES)
@given(batches=st.lists(st.tuples(bodies, signings), min_size=1, max_size=4))
def test_random_kv_event_batches_never_break_the_router(router, batches) -> None:
    client, index = router
    mirror = PrefixIndex(MAX_ENTRIES)  # what the index must hold: valid signed events only
    for url in INSTANCES:
        mirror.apply(url, parse_event({"instance": url, "cleared": True}))
    for url in INSTANCES:  # start every batch list from an empty index
        client.post("/kv_events", content=(body := json.dumps(
            {"instance": url, "cleared": True}).encode()),
            headers={FLEET_AUTH_HEADER: SECRET.sign("POST", "/kv_events", body)})
    assert entries(index) == entries(mirror)
    for body, signing in batches:
        signer = OTHER if signing == "other-fleet" else SECRET
        signed = signer.sign("POST", "/kv_events", body + b" " if signing == "other-body"
                             else body)
        headers = {"content-type": "application/json"}
        if signing != "none":
            headers[FLEET_AUTH_HEADER] = signed
        answer = client.post("/kv_events", content=body, headers=headers)
        assert answer.status_code < 500, answer.text
        try:
            event = parse_event(body)
        except ValueError:
            event = None
        if signing != "fleet":
            assert answer.status_code == 401, answer.text
        elif event is None:
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["message"]  # names the field
        else:
            assert answer.status_code == 200, answer.text
            raw = json.loads(body)  # what was taken is what the contract allows, by itself
            taken = [*raw.get("stored", []), *raw.get("removed", [])]
            assert all(type(h) is int and 0 <= h < 2**64 for h in taken), raw
            if event.instance.rstrip("/") in INSTANCES:
                mirror.apply(event.instance.rstrip("/"), event)
        assert entries(index) == entries(mirror)
        assert len(index) <= MAX_ENTRIES
    assert client.get("/health").status_code == 200  # still serving
