"""Repeated warnings summarised (`contracts/repeated_warnings.py`): the first of a kind at
once, then one count per interval; and the router's /kv_events polls of an engine that
refuses them (401) warn once, not on every refresh (issue 49, finding 6)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from router_fake_engine import FakeEngine, serving

from kvpilot.engine.contracts.fleet_secret import FleetSecret
from kvpilot.engine.contracts.http_auth import HttpAuth
from kvpilot.engine.contracts.repeated_warnings import MAX_KEYS, OTHER_KEY, RepeatedWarnings
from kvpilot.engine.contracts.router_args import RouterArgs
from kvpilot.engine.router.app import build_app

log = logging.getLogger("test.repeated")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == log.name]


# (seconds after the start of each warning from peer a, then what was logged)
@pytest.mark.parametrize(("times", "expected"), [
    ([0], ["bad from a"]),
    ([0, 1, 2, 59], ["bad from a"]),  # held back, counted
    ([0, 1, 2, 61], ["bad from a", "2 more bad connections from a in the last 61 s",
                     "bad from a"]),
    ([0, 61], ["bad from a", "bad from a"]),  # nothing held back: no count
])
def test_warn_table(caplog, times, expected):
    clock = Clock()
    warnings = RepeatedWarnings(log, "bad connections", interval=60, clock=clock)
    start = clock.now
    with caplog.at_level(logging.WARNING):
        for t in times:
            clock.now = start + t
            warnings.warn("a", "bad from %s", "a")
    assert lines(caplog) == expected


def test_flush_counts_the_held_back_once_the_interval_passed(caplog):
    clock = Clock()
    warnings = RepeatedWarnings(log, "bad connections", interval=60, clock=clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(316):  # the probe run
            warnings.warn("10.0.0.5", "bad from %s", "10.0.0.5")
        warnings.warn("10.0.0.6", "bad from %s", "10.0.0.6")
        warnings.flush()  # within the interval: nothing
        clock.now += 60
        warnings.flush()
        warnings.flush()  # counted once
        clock.now += 60
        warnings.flush()  # quiet for an interval: forgotten, and a new warning logs at once
        warnings.warn("10.0.0.5", "bad from %s", "10.0.0.5")
    assert lines(caplog) == ["bad from 10.0.0.5", "bad from 10.0.0.6",
                             "315 more bad connections from 10.0.0.5 in the last 60 s",
                             "bad from 10.0.0.5"]


def test_many_peers_share_one_count_past_the_bound(caplog):
    warnings = RepeatedWarnings(log, "bad connections", clock=Clock())
    with caplog.at_level(logging.WARNING):
        for peer in range(MAX_KEYS + 50):
            warnings.warn(str(peer), "bad from %s", peer)
    assert len(lines(caplog)) == MAX_KEYS + 1  # each known peer once, then one for the rest
    assert len(warnings._kinds) == MAX_KEYS + 1 and OTHER_KEY in warnings._kinds


class CharTokenizer:
    """One token per character: the router polls KV events only with a tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


class CountingAuth(HttpAuth):
    """The engine's check, counting its refusals."""

    refused = 0

    def refusal(self, *args, **kwargs):
        answer = super().refusal(*args, **kwargs)
        if answer is not None:
            type(self).refused += 1
        return answer


async def test_a_refused_kv_events_poll_warns_once_not_every_refresh(caplog):
    """A router without the fleet's secret polls an engine that requires it: every poll is a
    401. It warned on each refresh (every 2 s by default); now once per interval."""
    engine = FakeEngine("a")
    engine.require = CountingAuth(fleet=FleetSecret(b"\x05" * 32))
    with caplog.at_level(logging.WARNING, logger="kvpilot.router"):
        async with serving(engine.app()) as url:
            app = build_app(RouterArgs(instances=url, refresh_interval=0.02),
                            tokenizer=CharTokenizer())
            async with serving(app):
                for _ in range(1000):
                    if engine.require.refused >= 10:
                        break
                    await asyncio.sleep(0.02)
    assert engine.require.refused >= 10
    warned = [r.getMessage() for r in caplog.records if "/kv_events failed" in r.getMessage()]
    assert len(warned) == 1 and "401" in warned[0], warned
