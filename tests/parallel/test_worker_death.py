"""A tensor- or pipeline-parallel server whose worker is SIGKILLed fails fast and visibly: a
stream in flight ends with an error event, /ready and /health answer 503, new requests get
503, never a hang; and a worker killed while the server is idle takes readiness down too.
Under pipeline parallelism the worker is the last stage, which the driver waits on for
every step's logits."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
from helpers import sse

from kvpilot.engine.executor.processes import WORKER_MODULE

FLAGS = ["--model", "tiny-llama", "--device", "cpu", "--max-model-len", "4096",
         "--num-kv-blocks", "300", "--port", "0"]
TOPOLOGIES = {"tp2": ["--tensor-parallel-size", "2"], "pp2": ["--pipeline-parallel-size", "2"]}
FAIL_WITHIN_S = 10  # generous on a loaded 2-core machine; the watchdog polls every 0.2 s


@pytest.fixture(params=list(TOPOLOGIES))
def topology(request) -> list[str]:
    return TOPOLOGIES[request.param]


@contextmanager
def tp_server(log: Path, topology: list[str]) -> Iterator[tuple[str, psutil.Process]]:
    """Gives (base URL, the worker process) of a `kvpilot serve` with 2 ranks, once ready."""
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpilot.cli.main", "serve", *FLAGS,
                                 *topology], stdout=out, stderr=subprocess.STDOUT)
    try:
        base = None
        deadline = time.monotonic() + 120
        while base is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            found = re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))
            base = found.group(1) if found else None
            time.sleep(0.1)
        assert httpx.get(f"{base}/ready", timeout=10).status_code == 200
        # the workers are the engine core process's children
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if WORKER_MODULE in " ".join(p.cmdline())]
        assert len(workers) == 1
        yield base, workers[0]
    finally:
        proc.kill()
        proc.wait(30)


def wait_status(url: str, status: int, within: float) -> float:
    """Gives the seconds until GET `url` answered `status` (fails after `within`)."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        if httpx.get(url, timeout=5).status_code == status:
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer {status} within {within}s")


def test_worker_killed_mid_stream(tmp_path: Path, topology: list[str]):
    with tp_server(tmp_path / "serve.log", topology) as (base, worker):
        body = {"model": "tiny-llama", "prompt": "a long story", "max_tokens": 3000,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
            lines = (line for line in sse.iter_lines(resp) if line.startswith("data: "))
            assert json.loads(next(lines)[6:])["choices"]
            os.kill(worker.pid, signal.SIGKILL)
            killed = time.monotonic()
            last = [line for line in lines if line != "data: [DONE]"][-1]
            ended_after = time.monotonic() - killed
        assert ended_after < FAIL_WITHIN_S
        error = json.loads(last[6:])["error"]
        assert "parallel worker rank 1" in error["message"], error
        wait_status(f"{base}/ready", 503, FAIL_WITHIN_S)
        assert httpx.get(f"{base}/health", timeout=5).status_code == 503
        again = httpx.post(f"{base}/v1/completions", timeout=30,
                           json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 4})
        assert again.status_code == 503


def test_worker_killed_while_idle(tmp_path: Path, topology: list[str]):
    with tp_server(tmp_path / "serve.log", topology) as (base, worker):
        ok = httpx.post(f"{base}/v1/completions", timeout=60,
                        json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 4})
        assert ok.status_code == 200
        os.kill(worker.pid, signal.SIGKILL)
        wait_status(f"{base}/ready", 503, FAIL_WITHIN_S)
        refused = httpx.post(f"{base}/v1/completions", timeout=30,
                             json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 4})
        assert refused.status_code == 503
        assert "was killed by SIGKILL" in refused.json()["error"]["message"]
