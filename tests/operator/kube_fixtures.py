"""Fixtures for the emulator, the operator on it and a client (tests/operator and tests/autoscale).

Each conftest imports them by name; pytest finds fixtures in a conftest's namespace.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import kmock
import pytest
from kube_api import ApiServer
from operator_harness import NAMESPACE, crd_manifests, running_operator, write_kubeconfig


@pytest.fixture
async def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ApiServer]:
    """Gives a running emulator with core resources, kvpilot's CRDs and KUBECONFIG set to it."""
    async with ApiServer() as server, kmock.Server(server) as http:
        server.add_core_resources()
        for crd in crd_manifests():
            server.add_crd(crd)
        server.objects[kmock.resource("v1/namespaces"), None, NAMESPACE] = {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        server.base_url = str(http.url).rstrip("/")
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig",
                                                               str(http.url))))
        yield server


@pytest.fixture
async def operator(api: ApiServer) -> AsyncIterator[asyncio.Task[None]]:
    """Gives the real operator (every handler module, the autoscaler's too) running on `api`."""
    async with running_operator() as task:
        yield task


@pytest.fixture
async def client(api: ApiServer) -> AsyncIterator[httpx.AsyncClient]:
    """Gives an HTTP client for the emulator (what `kubectl` would send)."""
    async with httpx.AsyncClient(base_url=api.base_url) as http:
        yield http
