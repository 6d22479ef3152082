"""The engine core process's contract, with a fake engine on purpose where these tests need
controlled step timing (a step that takes 3 s) or a step that raises, and with the real
tiny-llama core for the death of the core mid-stream."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from helpers import sse
from server_fake_engine import (
    ByteTokenizer,
    fake_engine,
    fake_engine_deaf_to_sigterm,
    fake_engine_noting_gc,
    fake_engine_signalled_off_the_main_thread,
    fake_engine_with_a_worker,
)
from server_harness import MODEL, RunningCore, engine_core, serve_in_thread, tiny_app, wait_for

from kvpilot.engine.core_process.proc import SLOW_ITERATION_ENV
from kvpilot.engine.server.app import build_app

BODY = {"model": "fake", "prompt": "hi", "max_tokens": 3}


def fake_app(core: RunningCore):
    return build_app(core.handle, ByteTokenizer(), "fake")


def test_idle_core_does_not_spin() -> None:
    with engine_core(fake_engine) as core, serve_in_thread(fake_app(core)) as running:
        assert httpx.post(f"{running.base_url}/v1/completions", json=BODY).status_code == 200
        process = psutil.Process(core.process.pid)
        before = process.cpu_times()
        time.sleep(1.0)
        after = process.cpu_times()
        # sleeping in poll, not stepping: a spinning loop would burn most of the second
        assert (after.user + after.system) - (before.user + before.system) < 0.1


def test_a_sigterm_taken_by_another_thread_stops_the_idle_core() -> None:
    # the core's SIGTERM handler runs in its main thread, asleep in poll: the signal's
    # wake-up pipe must wake it (before the fix it slept on until its launcher's SIGKILL)
    with engine_core(fake_engine_signalled_off_the_main_thread) as core:
        core.process.process.join(60)
        assert core.process.process.exitcode == 0


def test_a_core_that_does_not_stop_logs_its_stacks_before_the_sigkill(capfd) -> None:
    with engine_core(fake_engine_deaf_to_sigterm) as core:
        core.process.stop(timeout=2.0)
        assert core.process.process.exitcode == -signal.SIGKILL
    err = capfd.readouterr().err
    assert "did not stop within 2 s of SIGTERM" in err
    assert "Current thread" in err and "proc.py" in err  # the main thread, in its loop


def test_the_core_may_start_processes_of_its_own() -> None:
    with engine_core(fake_engine_with_a_worker) as core, \
            serve_in_thread(fake_app(core)) as running:
        assert httpx.post(f"{running.base_url}/v1/completions", json=BODY).status_code == 200


def test_the_core_steps_with_its_start_up_heap_frozen_out_of_the_gc(tmp_path: Path) -> None:
    # on any device: a full collection walking the model's heap stalls every request
    noted = tmp_path / "frozen"
    build = functools.partial(fake_engine_noting_gc, path=str(noted))
    with engine_core(build) as core, serve_in_thread(fake_app(core)) as running:
        assert httpx.post(f"{running.base_url}/v1/completions", json=BODY).status_code == 200
    assert int(noted.read_text()) > 0


def test_slow_step_does_not_block_http() -> None:
    build = functools.partial(fake_engine, step_delay=3.0)
    with engine_core(build) as core, serve_in_thread(fake_app(core)) as running, \
            httpx.Client(timeout=30) as client:
        sent = time.monotonic()
        with client.stream("POST", f"{running.base_url}/v1/completions",
                           json={**BODY, "stream": True, "max_tokens": 1}) as resp:
            assert client.get(f"{running.base_url}/health").status_code == 200
            assert client.get(f"{running.base_url}/metrics").status_code == 200
            answered = time.monotonic()
            assert "[DONE]" in resp.read().decode()
        done = time.monotonic()
    assert answered - sent < 2.5 <= 3.0 <= done - sent  # answered during the one 3 s step


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_fails_requests_and_health(stream: bool) -> None:
    build = functools.partial(fake_engine, fail_on_step=1)
    with engine_core(build) as core, serve_in_thread(fake_app(core)) as running:
        resp = httpx.post(f"{running.base_url}/v1/completions", json={**BODY, "stream": stream},
                          timeout=30)
        if stream:
            assert resp.status_code == 200
            assert '"error"' in resp.text and "engine failed: RuntimeError: boom" in resp.text
        else:
            assert resp.status_code == 503
            assert "engine failed: RuntimeError: boom" in resp.json()["error"]["message"]
        assert httpx.get(f"{running.base_url}/health").status_code == 503
        assert httpx.get(f"{running.base_url}/ready").status_code == 503
        refused = httpx.post(f"{running.base_url}/v1/completions", json=BODY)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_dead"
        core.process.process.join(10)
        assert core.process.process.exitcode == 1  # the core exits after telling its servers


def test_a_failure_reported_between_steps_fails_streams_and_readiness() -> None:
    """An engine that reports a failure from another thread (`on_failure`: a tensor-parallel
    worker died) ends a stream in flight with an error event naming it, as a raising step does."""
    build = functools.partial(fake_engine, step_delay=0.05, break_on_step=3)
    with engine_core(build) as core, serve_in_thread(fake_app(core)) as running:
        events = []
        with httpx.stream("POST", f"{running.base_url}/v1/completions", timeout=30,
                          json={**BODY, "max_tokens": 100, "stream": True}) as resp:
            for line in sse.iter_lines(resp):
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        assert events[0]["choices"][0]["text"] == "a"  # tokens first, then the failure
        error = events[-1]["error"]
        assert error["code"] == 503
        assert error["message"] == "engine failed: fake worker rank 1 was killed by SIGKILL"
        assert httpx.get(f"{running.base_url}/ready").status_code == 503
        core.process.process.join(10)
        assert core.process.process.exitcode == 1


def test_a_failure_reported_while_idle_wakes_the_core() -> None:
    """The core sleeps in poll when idle; a failure reported then still takes readiness down
    and refuses new requests with the reason (a worker killed while the server is idle)."""
    build = functools.partial(fake_engine, break_on_step=BODY["max_tokens"], break_after_s=0.5)
    with engine_core(build) as core, serve_in_thread(fake_app(core)) as running:
        assert httpx.post(f"{running.base_url}/v1/completions", json=BODY).status_code == 200
        assert wait_for(lambda: httpx.get(f"{running.base_url}/ready").status_code == 503,
                        timeout=10)
        refused = httpx.post(f"{running.base_url}/v1/completions", json=BODY)
        assert refused.status_code == 503
        assert "fake worker rank 1 was killed by SIGKILL" in refused.json()["error"]["message"]


def stream_until_error(base: str, first: threading.Barrier, ended: dict[int, tuple], i: int
                       ) -> None:
    body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
        for line in sse.iter_lines(resp):
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if len(events) == 1:
                    first.wait(timeout=60)
    ended[i] = (time.monotonic(), events)


def test_killing_the_core_mid_stream_ends_every_stream_with_an_error() -> None:
    num_streams = 4
    with engine_core() as core, serve_in_thread(tiny_app(core)) as running:
        first = threading.Barrier(num_streams + 1)
        ended: dict[int, tuple] = {}
        threads = [threading.Thread(target=stream_until_error,
                                    args=(running.base_url, first, ended, i))
                   for i in range(num_streams)]
        for t in threads:
            t.start()
        first.wait(timeout=60)  # every stream has its first chunk
        assert core.process.pid is not None
        os.kill(core.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(timeout=30)
        assert len(ended) == num_streams
        for at, events in ended.values():
            assert at - killed < 2.0
            error = events[-1]["error"]
            assert error["code"] == 503 and "engine core process exited" in error["message"]
            assert events[-2]["choices"][0]["finish_reason"] is None  # cut mid-stream
        assert httpx.get(f"{running.base_url}/ready").status_code == 503
        assert httpx.get(f"{running.base_url}/health").status_code == 503
        refused = httpx.post(f"{running.base_url}/v1/completions", timeout=10,
                             json={"model": MODEL, "prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"


def test_slow_iterations_are_logged_with_their_breakdown(monkeypatch, capfd) -> None:
    """KVPILOT_SLOW_STEP_MS=N: the core logs each iteration longer than N ms with where the
    time went (its engine's `step_timing` included); shorter ones are not logged."""
    monkeypatch.setenv(SLOW_ITERATION_ENV, "100")  # the core process inherits it
    build = functools.partial(fake_engine, step_delay=0.15)
    with engine_core(build) as core, serve_in_thread(fake_app(core)) as running:
        assert httpx.post(f"{running.base_url}/v1/completions", json=BODY).status_code == 200
    lines = [line for line in capfd.readouterr().err.splitlines()
             if "slow engine iteration" in line]
    assert len(lines) == BODY["max_tokens"]  # one step per token, each slept past 100 ms
    assert "GPU wait 0.0 ms" in lines[0] and "GC " in lines[0] and "deliver " in lines[0]
    # bench/slow_steps.py, which summarizes these lines, still reads them
    spec = importlib.util.spec_from_file_location(
        "slow_steps", Path(__file__).parents[2] / "bench" / "slow_steps.py")
    assert spec is not None and spec.loader is not None
    slow_steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(slow_steps)
    parsed = slow_steps.LINE.search(lines[0]).groupdict()
    assert float(parsed["gpu"]) == 0.0 and float(parsed["total"]) >= 100
    monkeypatch.setenv(SLOW_ITERATION_ENV, "1000")
    with engine_core(build) as core, serve_in_thread(fake_app(core)) as running:
        assert httpx.post(f"{running.base_url}/v1/completions", json=BODY).status_code == 200
    assert "slow engine iteration" not in capfd.readouterr().err
