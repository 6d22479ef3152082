"""Helpers for the operator integration tests: CRDs, kubeconfig, the running operator, polling."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "default"
IMS = "kvpilot.dev/v1alpha1/inferencemodels"


def crd_manifests() -> list[dict[str, Any]]:
    """Gives the committed CRDs of crds/."""
    return [yaml.safe_load(p.read_text()) for p in sorted((REPO / "crds").glob("*.yaml"))]


def write_kubeconfig(path: Path, server: str) -> Path:
    """Writes a kubeconfig pointing at `server`; gives its path."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": server.rstrip("/")}}],
        "users": [{"name": "kmock", "user": {"token": "test"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock",
                                                   "namespace": NAMESPACE}}],
        "current-context": "kmock",
    }))
    return path


@contextlib.asynccontextmanager
async def running_operator(**memo: Any) -> AsyncIterator[asyncio.Task[None]]:
    """Runs the real kopf operator in this event loop until the block exits."""
    import kopf

    from kvpilot.operator.handlers import register
    from kvpilot.operator.handlers.lifecycle import operator_settings
    from kvpilot.operator.render.meta import RenderConfig

    register()
    ready = asyncio.Event()
    task = asyncio.create_task(kopf.operator(
        settings=operator_settings(fast=True), memo=kopf.Memo(render=RenderConfig(**memo)),
        clusterwide=True, standalone=True, ready_flag=ready))
    try:
        await asyncio.wait_for(ready.wait(), 120)  # kopf starts slowly on a loaded machine
        yield task
    finally:
        # Cancel rather than set the stop flag: kopf waits 5 s for every task started after
        # it, and in this event loop that includes the emulator's open watch streams.
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(task, 20)


async def eventually(check: Callable[[], Any | Awaitable[Any]], timeout: float = 120,
                     what: str = "condition") -> Any:
    """Gives the first truthy result of `check`, polling until `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what} did not hold within {timeout} s (last: {last!r})")
