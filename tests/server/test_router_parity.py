"""The router answers every bad request as the engine does: the engine's bad-input table
(`bad_requests.py`) and generated bodies, each sent to an engine and to a router in front of
it, get the same status and the same error body (issue 49: the router answered a lone
surrogate with a 500 and its own error shape)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from bad_requests import CASES, OK_CHAT, OK_COMPLETION, RAW_CASES
from hypothesis import given, settings
from hypothesis import strategies as st
from server_harness import RunningServer, serve_in_thread, wait_for

from kvpilot.engine.contracts.router_args import RouterArgs
from kvpilot.engine.router.app import build_app

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def router(server: RunningServer) -> Iterator[str]:
    """Gives the URL of a router in front of the module's engine server, once it routes."""
    args = RouterArgs(instances=f"both={server.base_url}", refresh_interval=0.2)
    with serve_in_thread(build_app(args)) as running:
        assert wait_for(lambda: httpx.get(f"{running.base_url}/ready").status_code == 200, 60)
        yield running.base_url


def both(server: RunningServer, router: str, route: str, raw: bytes
         ) -> tuple[httpx.Response, httpx.Response]:
    """Gives the engine's and the router's answers to the same bytes."""
    return tuple(httpx.post(base + route, content=raw, headers=JSON, timeout=60)  # type: ignore[return-value]
                 for base in (server.base_url, router))


def assert_same_refusal(engine: httpx.Response, routed: httpx.Response) -> None:
    assert routed.status_code == engine.status_code, (engine.text, routed.text)
    assert routed.json() == engine.json()


@pytest.mark.parametrize(("route", "change", "status", "param"), CASES,
                         ids=[f"{r.rsplit('/', 1)[-1]}-{next(iter(c))}-{s}"
                              for r, c, s, _ in CASES])
def test_table_through_the_router(server: RunningServer, router: str, route: str,
                                  change: dict[str, Any], status: int, param: str | None) -> None:
    body = {**(OK_COMPLETION if route == "/v1/completions" else OK_CHAT), **change}
    engine, routed = both(server, router, route, json.dumps(body).encode())
    assert engine.status_code == status
    assert_same_refusal(engine, routed)


@pytest.mark.parametrize(("route", "raw", "status", "param"), RAW_CASES,
                         ids=[repr(raw[:24]) for _, raw, _, _ in RAW_CASES])
def test_raw_bodies_through_the_router(server: RunningServer, router: str, route: str,
                                       raw: bytes, status: int, param: str | None) -> None:
    engine, routed = both(server, router, route, raw)
    assert (engine.status_code, engine.json()["error"]["param"]) == (status, param)
    assert_same_refusal(engine, routed)


SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\ud83d", "ok"])
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**65), 2**65),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                   SURROGATES, st.lists(st.one_of(st.integers(-3, 3), SURROGATES), max_size=3))
FIELDS = st.sampled_from(["prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                          "logprobs", "stream", "min_tokens", "model", "messages", "top_k"])


@settings(max_examples=40)
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       change=st.dictionaries(FIELDS, VALUES, min_size=1, max_size=3))
def test_generated_bodies_answer_alike(server: RunningServer, router: str, route: str,
                                       change: dict[str, Any]) -> None:
    body = {**(OK_COMPLETION if route == "/v1/completions" else OK_CHAT), **change,
            "max_tokens": change.get("max_tokens", 1)}
    engine, routed = both(server, router, route, json.dumps(body).encode())
    assert routed.status_code == engine.status_code, (body, engine.text, routed.text)
    if engine.status_code >= 400:
        assert routed.json() == engine.json()
    assert engine.status_code < 500, (body, engine.text)


def test_version_answers_on_both(server: RunningServer, router: str) -> None:
    """vLLM's GET /version was a 404 (issue 49)."""
    answers = [httpx.get(f"{base}/version", timeout=10) for base in (server.base_url, router)]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].json() == answers[1].json() and answers[0].json()["version"]
