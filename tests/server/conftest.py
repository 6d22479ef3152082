"""Fixtures of the server tests: one tiny-llama engine core process for the session, and an
API server on it per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import RunningCore, RunningServer, engine_core, serve_in_thread, tiny_app


@pytest.fixture(scope="session")
def core() -> Iterator[RunningCore]:
    """One engine core process for the session: loading the engine is the slow part."""
    with engine_core() as running:
        yield running


@pytest.fixture(scope="module")
def server(core: RunningCore) -> Iterator[RunningServer]:
    """A fresh API server app (core client, metrics registry) per test module on the shared
    core. Engine counters (tokens, prefix hits) are cumulative over the session: assert
    deltas."""
    with serve_in_thread(tiny_app(core)) as running:
        yield running
