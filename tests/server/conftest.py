"""Fixtures of the server tests: one real tiny-llama server per test module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from server_harness import MODEL, RunningServer, serve_in_thread, tiny_engine

from kvpilot.engine.server.app import build_app


@pytest.fixture(scope="session")
def engine() -> Any:
    """One real engine for the session: loading it is the slow part of these tests."""
    return tiny_engine()


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[RunningServer]:
    """A fresh app (engine thread, metrics registry) per test module over the shared engine.

    Modules run one after another, so only one engine thread drives the engine at a time.
    Engine counters (tokens, prefix hits) are cumulative over the session: assert deltas.
    """
    with serve_in_thread(build_app(engine, MODEL)) as running:
        yield running
