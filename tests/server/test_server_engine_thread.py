"""The engine thread's contract, with a fake engine on purpose: these tests need controlled
step timing (a step that takes 0.5 s), a step counter, and a step that raises."""

from __future__ import annotations

import gc
import importlib.util
import time
from pathlib import Path

import httpx
import pytest
from server_fake_engine import FakeEngine
from server_harness import serve_in_thread, wait_for

from kvpilot.engine.contracts.outputs import RequestOutput
from kvpilot.engine.server.app import build_app

BODY = {"model": "fake", "prompt": "hi", "max_tokens": 3}


class CountingEngine(FakeEngine):
    def __init__(self, step_delay: float = 0.0, fail_on_step: int | None = None) -> None:
        super().__init__(step_delay)
        self.steps = 0
        self.fail_on_step = fail_on_step
        self.in_step = False

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("boom")
        self.in_step = True
        try:
            return super().step()
        finally:
            self.in_step = False


def test_idle_engine_thread_does_not_step() -> None:
    engine = CountingEngine()
    with serve_in_thread(build_app(engine, "fake")) as running:
        assert httpx.post(f"{running.base_url}/v1/completions", json=BODY).status_code == 200
        steps = engine.steps
        time.sleep(0.3)
        assert engine.steps == steps  # sleeping on the condition, not spinning


def test_slow_step_does_not_block_http() -> None:
    engine = CountingEngine(step_delay=3.0)
    with serve_in_thread(build_app(engine, "fake")) as running, httpx.Client() as client, \
            client.stream("POST", f"{running.base_url}/v1/completions",
                          json={**BODY, "stream": True, "max_tokens": 1}) as resp:
        assert wait_for(lambda: engine.in_step, timeout=5)
        assert client.get(f"{running.base_url}/health").status_code == 200
        assert client.get(f"{running.base_url}/metrics").status_code == 200
        assert engine.in_step and engine.steps == 1  # answered during the one 3 s step
        assert "[DONE]" in resp.read().decode()


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_fails_requests_and_health(stream: bool) -> None:
    with serve_in_thread(build_app(CountingEngine(fail_on_step=1), "fake")) as running:
        resp = httpx.post(f"{running.base_url}/v1/completions", json={**BODY, "stream": stream})
        if stream:
            assert resp.status_code == 200
            assert '"error"' in resp.text and "engine failed" in resp.text
        else:
            assert resp.status_code == 503
        assert httpx.get(f"{running.base_url}/health").status_code == 503
        assert httpx.get(f"{running.base_url}/ready").status_code == 503
        refused = httpx.post(f"{running.base_url}/v1/completions", json=BODY)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_dead"


def test_slow_iterations_are_logged_with_their_breakdown(monkeypatch, caplog) -> None:
    """KVPILOT_SLOW_STEP_MS=N: iterations longer than N ms are logged with where the time went
    (an engine's own `step_timing` included); shorter ones are not."""
    from kvpilot.engine.server.async_engine import SLOW_ITERATION_ENV

    class TimedEngine(CountingEngine):
        def step_timing(self) -> str:
            return "GPU wait 1.0 ms"

    monkeypatch.setenv(SLOW_ITERATION_ENV, "100")
    engine = TimedEngine(step_delay=0.15)
    callbacks = len(gc.callbacks)
    with caplog.at_level("WARNING", logger="kvpilot.engine.server.async_engine"), \
            serve_in_thread(build_app(engine, "fake")) as running:
        assert httpx.post(f"{running.base_url}/v1/completions", json=BODY).status_code == 200
    assert wait_for(lambda: len(gc.callbacks) == callbacks, timeout=5)  # its GC clock is gone
    lines = [r.getMessage() for r in caplog.records if "slow engine iteration" in r.getMessage()]
    assert len(lines) == engine.steps >= 1  # every step slept past 100 ms
    assert "GPU wait 1.0 ms" in lines[0] and "GC " in lines[0] and "deliver " in lines[0]
    # bench/slow_steps.py, which summarizes these lines, still reads them
    spec = importlib.util.spec_from_file_location(
        "slow_steps", Path(__file__).parents[2] / "bench" / "slow_steps.py")
    slow_steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(slow_steps)
    parsed = slow_steps.LINE.search(lines[0]).groupdict()
    assert float(parsed["gpu"]) == 1.0 and float(parsed["total"]) >= 100
    monkeypatch.setenv(SLOW_ITERATION_ENV, "1000")
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvpilot.engine.server.async_engine"), \
            serve_in_thread(build_app(CountingEngine(step_delay=0.15), "fake")) as running:
        assert httpx.post(f"{running.base_url}/v1/completions", json=BODY).status_code == 200
    assert not [r for r in caplog.records if "slow engine iteration" in r.getMessage()]
