"""Fixtures for the autoscaler's integration tests: the operator tests' kmock emulator and
operator harness (reused from tests/operator), real engine processes, and a pod 'controller'."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpilot.operator.local.supervisor import free_port

OPERATOR_TESTS = Path(__file__).resolve().parents[1] / "operator"
sys.path.insert(0, str(OPERATOR_TESTS))
from kube_fixtures import api, client, operator  # noqa: E402, F401  (fixtures, found by name)

ENGINE_FLAGS = ["--model", "tiny-llama", "--max-num-seqs", "2", "--num-kv-blocks", "256",
                "--log-level", "warning"]


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
