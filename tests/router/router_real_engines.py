"""Real `kvpilot serve` processes of the tiny model (CPU), for the router's failure tests."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvpilot.operator.local.supervisor import free_port

TINY = ["--model", "tiny-llama", "--device", "cpu", "--max-model-len", "256",
        "--num-kv-blocks", "64", "--max-num-seqs", "8"]


def start_engine(log: Path, port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Starts one engine on `port` (a free one by default); gives it and its URL (not ready yet)."""
    port = port or free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpilot.cli", "serve", *TINY,
                                 "--port", str(port), "--log-level", "warning"],
                                stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(engines: list[tuple[subprocess.Popen[bytes], str]], seconds: float = 120) -> None:
    """Waits until every engine answers /ready; raises with its log otherwise."""
    deadline = time.monotonic() + seconds
    pending = list(engines)
    while pending:
        proc, url = pending[0]
        assert proc.poll() is None, f"{url} exited with {proc.returncode}"
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                pending.pop(0)
                continue
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready after {seconds}s"
        time.sleep(0.1)


def stop_all(engines: list[tuple[subprocess.Popen[bytes], str]]) -> None:
    """Kills the engines (a stopped one too) and reaps them."""
    for proc, _ in engines:
        proc.kill()
    for proc, _ in engines:
        proc.wait(30)
