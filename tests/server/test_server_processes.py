"""`kvpilot serve`'s processes: the engine core beside the API server(s), `--api-server-count`,
and no core left behind when `kvpilot serve` goes away."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from server_harness import MODEL, TINY_ENGINE, start_server

NUM_REQUESTS = 8


def spawned_children(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """Gives the processes `kvpilot serve` started with multiprocessing (core, API servers)."""
    return [p for p in psutil.Process(proc.pid).children()
            if "spawn_main" in " ".join(p.cmdline())]


def success_count(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    prefix = f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}} '
    return sum(float(line[len(prefix):]) for line in text.splitlines()
               if line.startswith(prefix))


def token_counts(base: str) -> tuple[float, float]:
    """Gives (vllm:iteration_tokens_total's sum, prompt plus generation tokens) of a scrape."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    label = f'{{model_name="{MODEL}"}} '
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.endswith(tuple("0123456789")) and label in line}
    return (values["vllm:iteration_tokens_total_sum"],
            values["vllm:prompt_tokens_total"] + values["vllm:generation_tokens_total"])


def test_two_api_servers_share_the_port_metrics_and_drain(tmp_path: Path) -> None:
    proc, base = start_server(tmp_path / "serve.log", extra=("--api-server-count", "2"))
    try:
        children = spawned_children(proc)
        assert len(children) == 3  # the engine core and two API servers
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            answers = list(pool.map(
                lambda _: httpx.post(f"{base}/v1/completions", json=body, timeout=60),
                range(NUM_REQUESTS)))
        assert [a.status_code for a in answers] == [200] * NUM_REQUESTS
        # whichever API server a scrape reaches, it counts every server's requests
        assert [success_count(base) for _ in range(6)] == [NUM_REQUESTS] * 6
        # tokens per engine step come from the core's counts: not summed over the servers
        # (an API server's snapshot may trail the core's last broadcast for a moment)
        for _ in range(150):
            counts = [token_counts(base) for _ in range(6)]
            if all(steps == tokens for steps, tokens in counts):
                break
            time.sleep(0.2)
        assert all(steps == tokens >= NUM_REQUESTS * 4 for steps, tokens in counts), counts
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_sigterm_while_the_api_servers_start_drains_them(tmp_path: Path) -> None:
    # The launcher says it listens, then spawns its API servers, which take seconds to
    # import their app: a SIGTERM at once reaches them before they serve.
    log = tmp_path / "serve.log"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY_ENGINE.items() if k != "model"]
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpilot.cli", "serve", MODEL, *flags,
                                 "--port", "0", "--api-server-count", "2"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "listening on" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        children = spawned_children(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()
        _, alive = psutil.wait_procs(children, timeout=20)
        assert not alive
    finally:
        if proc.poll() is None:
            proc.kill()


def test_api_servers_and_core_stop_when_their_launcher_is_killed(tmp_path: Path) -> None:
    proc, _ = start_server(tmp_path / "serve.log", extra=("--api-server-count", "2"))
    children = spawned_children(proc)
    proc.kill()  # no drain, no clean-up: each child sees its parent's end by itself
    proc.wait(timeout=10)
    _, alive = psutil.wait_procs(children, timeout=20)
    for process in alive:  # so that a failure leaves nothing behind
        process.kill()
    assert not alive


def test_the_core_stops_when_kvpilot_serve_is_killed(tmp_path: Path) -> None:
    proc, _ = start_server(tmp_path / "serve.log")
    (core,) = spawned_children(proc)
    proc.kill()  # no drain, no clean-up: the core sees its parent's end by itself
    proc.wait(timeout=10)
    _, alive = psutil.wait_procs([core], timeout=10)
    for process in alive:  # so that a failure leaves nothing behind
        process.kill()
    assert not alive


def test_api_server_modules_do_not_import_torch() -> None:
    # an API server process starts fast: the engine core alone loads torch
    code = ("import sys, kvpilot.engine.server.cli, kvpilot.engine.server.app, "
            "kvpilot.engine.server.api_servers, kvpilot.engine.core_process.client, "
            "kvpilot.engine.core_process.launch, kvpilot.engine.engine_loop.request_state; "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
