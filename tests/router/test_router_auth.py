"""The router's paths (`contracts/http_auth.py`): POST /kv_events needs the fleet signature
(or, without a secret, the API key) and bounds every entry; /v1/* needs the API key, which the
router also sends the engines; its /kv_events polls of the engines are signed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from router_fake_engine import FakeEngine, serving

from kvpilot.engine.contracts.fleet_secret import FLEET_AUTH_HEADER, FleetSecret
from kvpilot.engine.contracts.http_auth import HttpAuth
from kvpilot.engine.contracts.router_args import RouterArgs
from kvpilot.engine.router.app import build_app
from kvpilot.engine.router.kv_events import MAX_BODY_BYTES, MAX_HASHES

SECRET = FleetSecret(b"\x05" * 32)
KEY = "sesame"
COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


class CharTokenizer:
    """One token per character: the router polls KV events only with a tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


@pytest.fixture
def secret_file(tmp_path) -> str:
    path = tmp_path / "secret"
    path.write_text(SECRET.secret.hex())
    return str(path)


def post_events(client: httpx.AsyncClient, event: dict | bytes, secret: FleetSecret | None,
                **headers: str):
    body = event if isinstance(event, bytes) else json.dumps(event).encode()
    if secret is not None:
        headers[FLEET_AUTH_HEADER] = secret.sign("POST", "/kv_events", body)
    return client.post("/kv_events", content=body,
                       headers={"content-type": "application/json", **headers})


async def test_posted_kv_events_need_the_fleet_signature(fleet, secret_file):
    router, urls = await fleet([FakeEngine("a")], fleet_secret_file=secret_file, api_key=KEY)
    event = {"instance": urls["a"], "stored": [1, 2, 3]}
    async with httpx.AsyncClient(base_url=router) as client:
        refused = [await post_events(client, event, None),
                   await post_events(client, event, None, authorization=f"Bearer {KEY}"),
                   await post_events(client, event, FleetSecret(b"\x06" * 32))]
        accepted = await post_events(client, event, SECRET)
    assert [r.status_code for r in refused] == [401, 401, 401]
    assert refused[0].json()["error"]["type"] == "authentication_error"
    assert accepted.status_code == 200 and accepted.json() == {"entries": 3}


async def test_without_a_secret_the_api_key_guards_posted_kv_events(fleet):
    router, urls = await fleet([FakeEngine("a")], api_key=KEY)
    event = {"instance": urls["a"], "stored": [1]}
    async with httpx.AsyncClient(base_url=router) as client:
        assert (await post_events(client, event, None)).status_code == 401  # the issue: 200
        answer = await post_events(client, event, None, authorization=f"Bearer {KEY}")
    assert answer.status_code == 200


@pytest.mark.parametrize(("event", "param", "words"), [
    ({"stored": [int("9" * 4000)]}, "stored.0", "less than or equal to 18446744073709551615"),
    ({"removed": [-1]}, "removed.0", "greater than or equal to 0"),
    ({"stored": ["12"]}, "stored.0", "valid integer"),
    ({"stored": [1.5]}, "stored.0", "valid integer"),
    ({"stored": list(range(MAX_HASHES + 1))}, "stored", "at most 65536"),
    ({"stored": list(range(40_000)), "removed": list(range(40_000))}, "body", "at most 65536"),
    ({"cleared": "yes"}, "cleared", "valid boolean"),
    ({"instance": "x" * 5000}, "instance", "at most 2048"),
    ({"extra": 1}, "extra", "not permitted"),
])
async def test_every_posted_entry_is_bounded(fleet, secret_file, event, param, words):
    router, urls = await fleet([FakeEngine("a")], fleet_secret_file=secret_file)
    async with httpx.AsyncClient(base_url=router, timeout=30) as client:
        answer = await post_events(client, {"instance": urls["a"], **event}, SECRET)
        entries = (await post_events(client, {"instance": urls["a"]}, SECRET)).json()
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert len(error["message"]) < 400  # a 4,000-digit value is not echoed whole
    assert entries == {"entries": 0}  # nothing of the refused batch went in


async def test_an_oversized_body_is_refused_before_it_is_read_whole(fleet, secret_file):
    router, _ = await fleet([FakeEngine("a")], fleet_secret_file=secret_file)
    body = b'{"stored": [' + b"1," * (MAX_BODY_BYTES // 2) + b"1]}"
    async with httpx.AsyncClient(base_url=router, timeout=30) as client:
        answer = await post_events(client, body, SECRET)
    assert answer.status_code == 413, answer.text
    assert f"at most {MAX_BODY_BYTES}" in answer.json()["error"]["message"]


async def test_the_router_sends_its_api_key_to_the_engines(fleet):
    engine = FakeEngine("a")
    router, _ = await fleet([engine], api_key=KEY)
    async with httpx.AsyncClient(base_url=router) as client:
        missing = await client.post("/v1/completions", json=COMPLETION)
        served = await client.post("/v1/completions", json=COMPLETION,
                                   headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 401 and served.status_code == 200
    assert engine.authorization == [f"Bearer {KEY}"]  # one request reached it, with the key


async def test_the_router_signs_its_kv_events_polls(fleet, secret_file):
    """A fake engine that checks the signature; the router polls it (with a tokenizer)."""
    engine = FakeEngine("a")
    engine.kv_events.stored(42)
    engine.require = HttpAuth(fleet=SECRET)  # GET /kv_events answers 401 unless signed
    async with serving(engine.app()) as url:
        args = RouterArgs(instances=url, fleet_secret_file=secret_file, refresh_interval=0.05)
        app = build_app(args, tokenizer=CharTokenizer())
        async with serving(app):
            index = app.state.router.index
            for _ in range(200):
                if index.size(url):
                    break
                await asyncio.sleep(0.05)
            assert index.match(url, [42]) == 1

