"""Fixtures for the autoscaler's integration tests: the operator tests' kmock emulator and
operator harness (reused from tests/operator), real engine processes, and a pod 'controller'."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import attrs
import httpx
import jsonpatch
import kmock
import pytest
from kmock._internal import enums
from kmock._internal.k8s import KubernetesError

OPERATOR_TESTS = Path(__file__).resolve().parents[1] / "operator"
sys.path.insert(0, str(OPERATOR_TESTS))
from kube_api import ApiServer  # noqa: E402
from operator_harness import (  # noqa: E402
    NAMESPACE,
    crd_manifests,
    running_operator,
    write_kubeconfig,
)

ENGINE_FLAGS = ["--model", "tiny-llama", "--max-num-seqs", "2", "--num-kv-blocks", "256",
                "--log-level", "warning"]


@attrs.define(kw_only=True)
class Emulator(ApiServer):
    """The operator tests' emulator plus two API-server behaviours the autoscaler's frequent
    writes need: `metadata.generateName` (kopf's events; without it every event after the
    first collides on an empty name) and HTTP 422 for a failed JSON-patch `test` of
    resourceVersion (kopf then retries on the next cycle; on a 500 it stalls the object
    for nine backed-off attempts)."""

    async def _handle(self, request: kmock.Request) -> object:
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as exc:
            raise KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engines() -> Iterator[list[tuple[int, subprocess.Popen[bytes]]]]:
    """Gives two real `kvpilot serve` processes (tiny-llama, 2 sequences, 256 KV blocks)."""
    kvpilot = str(Path(sys.executable).with_name("kvpilot"))
    procs = []
    for _ in range(2):
        port = free_port()
        proc = subprocess.Popen([kvpilot, "serve", *ENGINE_FLAGS, "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        procs.append((port, proc))
    deadline = time.monotonic() + 90
    try:
        for port, proc in procs:
            while True:
                assert proc.poll() is None, f"engine on port {port} exited with {proc.returncode}"
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success:
                        break
                assert time.monotonic() < deadline, "engines did not start within 90 s"
                time.sleep(0.3)
        yield procs
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()


@pytest.fixture
async def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ApiServer]:
    """Gives a running emulator with core resources, kvpilot's CRDs and KUBECONFIG set to it."""
    async with Emulator() as server, kmock.Server(server) as http:
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
