"""Harness of the server tests: an engine core process (a real tiny-llama engine, or a fake)
and an API server app on it, served by uvicorn on a free port in a thread."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.tokenizer import load_tokenizer
from kvpilot.engine.core_process.entry import EngineBuilder, build_engine
from kvpilot.engine.core_process.launch import CoreHandle, CoreProcess
from kvpilot.engine.server.app import build_app

MODEL = "tiny-llama"
# Small enough for fast CPU steps, long enough for the drain and length tests.
TINY_ENGINE = {"model": MODEL, "max_model_len": 512, "max_num_seqs": 16, "num_kv_blocks": 128,
               "device": "cpu"}


@dataclass
class RunningCore:
    """An engine core process and the handle its API servers connect with."""

    process: CoreProcess
    handle: CoreHandle


@contextmanager
def engine_core(build: EngineBuilder = build_engine, **overrides: Any) -> Iterator[RunningCore]:
    """Runs an engine core process until the block exits: tiny-llama on CPU with `overrides`,
    or what `build` (a picklable function) gives."""
    process = CoreProcess.start(EngineArgs(**{**TINY_ENGINE, **overrides}), "127.0.0.1", 0,
                                "warning", build)
    try:
        yield RunningCore(process, process.wait_ready(timeout=120))
    finally:
        process.stop()


def tiny_app(core: RunningCore, **kwargs: Any) -> Any:
    """Gives the API server app of a tiny-llama core."""
    return build_app(core.handle, load_tokenizer(MODEL), MODEL, **kwargs)


@dataclass
class RunningServer:
    """A server running in a background thread of the test process."""

    base_url: str
    app: Any
    server: uvicorn.Server

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Gives {(sample name, sorted labels): value} scraped from /metrics."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(self, name: str, **labels: str) -> float:
        """Gives one sample's value (labels beyond model_name must be given)."""
        key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
        return self.metrics().get(key, 0.0)


@contextmanager
def serve_in_thread(app: Any) -> Iterator[RunningServer]:
    """Runs `app` with uvicorn on 127.0.0.1:<free port> until the block exits."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", app, server)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Gives whether `predicate()` became true within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def start_server(log: Path, drain_timeout: float = 60,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], str]:
    """Gives a `kvpilot serve MODEL` subprocess on a free port and its base URL."""
    flags = [TINY_ENGINE["model"], *(f"--{k.replace('_', '-')}={v}"
                                     for k, v in TINY_ENGINE.items() if k != "model")]
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpilot.cli", "serve", *flags,
                                 "--port", "0", "--drain-timeout", str(drain_timeout), *extra],
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        found = re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))
        if found:
            base = found.group(1)
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    return proc, base
            except httpx.TransportError:
                pass
        assert proc.poll() is None, log.read_text()
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"server did not become ready:\n{log.read_text()}")
