"""Fixtures of the router tests: fake engines and a router, each a uvicorn server on 127.0.0.1."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import uvicorn
from router_fake_engine import FakeEngine, serving, stop_all

from kvpilot.engine.contracts.router_args import RouterArgs
from kvpilot.engine.router.app import build_app


@pytest.fixture
async def fleet() -> AsyncIterator[Callable[..., Any]]:
    """Gives `start(engines, late=None, **router_args) -> (router_url, {name: engine_url})`."""
    stack = contextlib.AsyncExitStack()
    servers: list[uvicorn.Server] = []

    async def start(engines: list[FakeEngine], late: Callable[[dict[str, str]], dict] | None = None,
                    **router_kwargs: Any) -> tuple[str, dict[str, str]]:
        urls = {e.name: await stack.enter_async_context(serving(e.app(), servers)) for e in engines}
        router_kwargs.update(late(urls) if late else {})  # args that depend on the ports
        spec = ",".join(f"{e.role}={urls[e.name]}" for e in engines)
        router_kwargs.setdefault("refresh_interval", 0.1)
        args = RouterArgs(instances=spec, **router_kwargs)
        router_url = await stack.enter_async_context(serving(build_app(args), servers))
        return router_url, urls

    async with stack:
        yield start
        stop_all(servers)  # together, then the stack awaits each
