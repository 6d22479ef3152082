"""Fixtures of the server tests: one real tiny-llama server per test module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kvpilot.engine.server.app import build_app
from server_harness import MODEL, RunningServer, serve_in_thread, tiny_engine


@pytest.fixture(scope="module")
def engine() -> Any:
    return tiny_engine()


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[RunningServer]:
    """A tiny-llama server shared by one test module."""
    with serve_in_thread(build_app(engine, MODEL)) as running:
        yield running
