"""A request whose tries all failed before its first byte holds for an instance to come back
(`router.tries`): within --hold-timeout it is answered by the one that did, past it it gets
a 502 naming the bound; the number of tries stays within 1 + 2 x --max-retries.

A replica that is down here answers 500 and its health check hangs (the router hears
nothing from it, as from a killed or stopped replica); it comes back when it answers again."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from router_fake_engine import FakeEngine

from kvpilot.engine.contracts.router_args import SERVED_BY_HEADER

COMPLETION = {"model": "tiny", "prompt": "hold me", "max_tokens": 4}
HOLD = 3.0  # seconds; --hold-timeout of the hold cases


def down(name: str) -> FakeEngine:
    return FakeEngine(name, mode="fail500")


async def tried(engines: list[FakeEngine], count: int, limit: float = 30.0) -> None:
    """Returns once the engines were sent `count` requests in all (fails after `limit` s)."""
    start = time.monotonic()
    while sum(len(e.bodies) for e in engines) < count:
        assert time.monotonic() - start < limit, [len(e.bodies) for e in engines]
        await asyncio.sleep(0.02)


@pytest.mark.parametrize(("stream", "recovers", "status", "message"), [
    (False, "b", 200, None),  # b comes back within the hold: it answers
    (True, "b", 200, None),
    (False, None, 502, f"within --hold-timeout={HOLD:g}s"),  # none does: the named error
    (True, None, 502, f"within --hold-timeout={HOLD:g}s"),
])
async def test_all_failed_then_one_comes_back_within_the_hold(fleet, stream, recovers, status,
                                                              message):
    engines = [down("a"), down("b")]
    router, urls = await fleet(engines, hold_timeout=HOLD, max_retries=2,
                               eject_after_failures=100, refresh_interval=0.05)
    async with httpx.AsyncClient(base_url=router, timeout=60) as client:
        assert (await client.get("/ready")).status_code == 200
        for engine in engines:  # from now on the router hears nothing from them
            engine.silent = True
        try:
            start = time.monotonic()
            sent = asyncio.create_task(client.post("/v1/completions",
                                                   json={**COMPLETION, "stream": stream}))
            await tried(engines, 2)  # each failed it once: it holds
            if recovers:
                back = next(e for e in engines if e.name == recovers)
                back.mode, back.silent = "ok", False
            response = await sent
            took = time.monotonic() - start
        finally:
            for engine in engines:
                engine.silent = False
    assert response.status_code == status, response.text
    if recovers:
        assert response.headers[SERVED_BY_HEADER] == urls[recovers]
        assert took < HOLD + 10
    else:
        assert message in response.json()["error"]["message"]
        assert HOLD * 0.9 <= took < HOLD + 15, took  # about the hold time
        assert sum(len(e.bodies) for e in engines) == 2  # neither came back: no third try


# tries before holding: 1 + max_retries, or fewer once each of the two failed it; then
# max_retries more: never over 1 + 2 x max_retries
@pytest.mark.parametrize(("max_retries", "tries"), [(0, 1), (1, 3), (2, 4), (3, 5)])
async def test_the_tries_stay_within_their_bound(fleet, max_retries, tries):
    # both come back at every health check (they answer it) and fail again: only the
    # --max-retries bound ends the request, long before the hold time
    engines = [down("a"), down("b")]
    router, _ = await fleet(engines, max_retries=max_retries, hold_timeout=60,
                            eject_after_failures=100, refresh_interval=0.05)
    async with httpx.AsyncClient(base_url=router, timeout=60) as client:
        response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_error"
    assert f"all {tries} attempts failed (--max-retries={max_retries}" in error["message"]
    assert sum(len(e.bodies) for e in engines) == tries
