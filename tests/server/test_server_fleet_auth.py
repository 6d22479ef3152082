"""Who may call which path of an engine (`contracts/http_auth.py`): GET /kv_events needs the
fleet secret's signature even without --api-key; the API key covers /v1/* (and /metrics when
asked); salted hashes agree between the engine and the router's hasher."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from server_harness import MODEL, RunningCore, RunningServer, engine_core, serve_in_thread, tiny_app

from kvpilot.engine.contracts.args import API_KEY_ENV, EngineArgs, resolve_api_key
from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.contracts.fleet_secret import FLEET_AUTH_HEADER, FleetSecret
from kvpilot.engine.contracts.http_auth import HttpAuth
from kvpilot.engine.contracts.tokenizer import load_tokenizer
from kvpilot.engine.router.prompt import PromptHasher

SECRET = FleetSecret(b"\x01" * 32)
KEY = "sesame"
PROMPT = "the fleet secret salts every block hash " * 4


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Iterator[tuple[RunningServer, RunningCore]]:
    """An engine core started with --fleet-secret-file, served with an API key too."""
    path = tmp_path_factory.mktemp("fleet") / "secret"
    path.write_text(f"  {SECRET.secret.hex()}\n")
    with engine_core(fleet_secret_file=str(path)) as core, \
            serve_in_thread(tiny_app(core, auth=HttpAuth(KEY, SECRET))) as running:
        yield running, core


def signed(secret: FleetSecret, target: str, age: float = 0.0) -> dict[str, str]:
    return {FLEET_AUTH_HEADER: secret.sign("GET", target, now=time.time() - age)}


@pytest.mark.parametrize(("headers", "status"), [  # headers signed when the test runs
    (lambda: {}, 401),  # the issue: open to anyone
    (lambda: {"Authorization": f"Bearer {KEY}"}, 401),  # a user's key does not read the cache
    (lambda: signed(FleetSecret(b"\x02" * 32), "/kv_events?since=0"), 401),  # another fleet
    (lambda: signed(SECRET, "/kv_events?since=1"), 401),  # signed for another query
    (lambda: signed(SECRET, "/kv_events?since=0", age=3600), 401),  # an hour old
    (lambda: {FLEET_AUTH_HEADER: "garbage"}, 401),
    (lambda: signed(SECRET, "/kv_events?since=0"), 200),
])
def test_kv_events_need_the_fleet_signature(secured, headers, status):
    server, _ = secured
    answer = httpx.get(f"{server.base_url}/kv_events?since=0", headers=headers(), timeout=10)
    assert answer.status_code == status, answer.text
    if status == 401:
        assert answer.json()["error"]["code"] == "invalid_fleet_auth"
        assert FLEET_AUTH_HEADER in answer.json()["error"]["message"]


@pytest.mark.parametrize(("auth", "path", "headers", "status"), [
    (HttpAuth(), "/kv_events", {}, 200),  # no secret, no key: open in-process test apps
    # kvpilot serve without --insecure-kv: closed (it served block hashes to anyone)
    (HttpAuth(open_fleet_paths=False), "/kv_events", {}, 401),
    # the scheme is case-insensitive (RFC 9110); `bearer KEY` was a 401
    (HttpAuth(KEY), "/v1/models", {"Authorization": f"bearer {KEY}"}, 200),
    (HttpAuth(KEY), "/v1/models", {"Authorization": f"BEARER  {KEY}"}, 200),
    (HttpAuth(KEY), "/v1/models", {"Authorization": f"Basic {KEY}"}, 401),
    (HttpAuth(KEY), "/v1/models", {"Authorization": KEY}, 401),
    (HttpAuth(KEY), "/kv_events", {}, 401),  # a key but no secret: the key guards it
    (HttpAuth(KEY), "/kv_events", {"Authorization": f"Bearer {KEY}"}, 200),
    (HttpAuth(KEY), "/v1/models", {}, 401),
    (HttpAuth(KEY), "/v1/models", {"Authorization": f"Bearer {KEY}"}, 200),
    (HttpAuth(KEY), "/metrics", {}, 200),  # open by default, as vLLM's
    (HttpAuth(KEY, metrics_require_api_key=True), "/metrics", {}, 401),
    (HttpAuth(KEY, metrics_require_api_key=True), "/metrics",
     {"Authorization": f"Bearer {KEY}"}, 200),
    (HttpAuth(KEY, SECRET, metrics_require_api_key=True), "/health", {}, 200),
    (HttpAuth(KEY, SECRET, metrics_require_api_key=True), "/ready", {}, 200),
])
def test_which_credential_each_path_needs(core: RunningCore, auth, path, headers, status):
    with serve_in_thread(tiny_app(core, auth=auth)) as running:
        answer = httpx.get(running.base_url + path, headers=headers, timeout=10)
    assert answer.status_code == status, answer.text


def test_the_api_key_comes_from_the_environment_when_the_flag_is_absent(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("from-flag") == "from-flag"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert resolve_api_key(None) is None


def test_the_engine_salts_its_hashes_and_the_router_derives_the_same(secured):
    server, _ = secured
    block_size = EngineArgs(model=MODEL).block_size  # the core's: the harness keeps the default
    target = "/kv_events?since=0"
    start = httpx.get(server.base_url + target, headers=signed(SECRET, target),
                      timeout=10).json()["next"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    sent = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert sent.status_code == 200, sent.text
    target = f"/kv_events?since={start}"
    events = httpx.get(server.base_url + target, headers=signed(SECRET, target),
                       timeout=10).json()["events"]
    stored = [h for event in events for h in event.get("stored", [])]
    tokenizer = load_tokenizer(MODEL)
    router = PromptHasher(block_size, tokenizer, SECRET.block_hash_salt)
    expected = router.hashes(body)
    assert len(expected) >= 2 and stored[:len(expected)] == expected
    ids = tokenizer.encode(PROMPT)
    assert expected != hash_prompt_blocks(ids, block_size)  # unsalted


@pytest.mark.parametrize(("text", "error"), [
    (None, "cannot be read"),
    ("not hex at all", "does not hold hex text"),
    ("abcd", "holds 2 bytes"),
])
def test_a_bad_fleet_secret_file_is_refused_naming_the_flag(tmp_path, text, error):
    path = tmp_path / "secret"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=error) as caught:
        FleetSecret.from_file(str(path))
    assert str(caught.value).startswith(f"fleet_secret_file={str(path)!r}")
