"""SIGTERM during 8 in-flight streams: all finish, new requests are refused, the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx
from helpers import sse
from server_harness import MODEL, start_server, wait_for

NUM_STREAMS = 8
# Long enough that the drain outlasts the refused-request check even on a fast CPU
# (200 steps), short enough for CI.
MAX_TOKENS = 200


def stream_one(base: str, started: threading.Barrier, results: list[dict], i: int) -> None:
    body = {"model": MODEL, "prompt": f"stream number {i}", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text, finish, usage, done = "", None, None, False
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as resp:
        first = True
        for line in sse.iter_lines(resp):
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text += choice["text"]
                finish = choice["finish_reason"] or finish
            usage = chunk.get("usage") or usage
            if first:
                first = False
                started.wait(timeout=60)
    results[i] = {"status": resp.status_code, "finish": finish, "usage": usage, "done": done}


def test_sigterm_drains_in_flight_streams_then_exits_zero(tmp_path: Path) -> None:
    proc, base = start_server(tmp_path / "serve.log",
                              extra=("--max-model-len", "1024", "--num-kv-blocks", "256"))
    try:
        started = threading.Barrier(NUM_STREAMS + 1)
        results: list[dict] = [{} for _ in range(NUM_STREAMS)]
        threads = [threading.Thread(target=stream_one, args=(base, started, results, i))
                   for i in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        started.wait(timeout=60)  # every stream has its first chunk
        proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: httpx.get(f"{base}/ready", timeout=5).status_code == 503)
        refused = httpx.post(f"{base}/v1/completions", timeout=10,
                             json={"model": MODEL, "prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert f'kvpilot_draining{{model_name="{MODEL}"}} 1.0' in metrics
        for t in threads:
            t.join(timeout=120)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for result in results:
        assert result["status"] == 200
        assert result["done"] and result["finish"] == "length"
        assert result["usage"]["completion_tokens"] == MAX_TOKENS



def test_drain_timeout_cuts_long_streams_and_still_exits_zero(tmp_path: Path) -> None:
    # A 4000-token stream cannot finish inside a 0.5 s drain, however idle the CPU.
    proc, base = start_server(tmp_path / "serve.log", drain_timeout=0.5,
                              extra=("--max-model-len", "4096", "--num-kv-blocks", "512"))
    try:
        body = {"model": MODEL, "prompt": "endless", "max_tokens": 4000, "ignore_eos": True,
                "stream": True}
        chunks, last = 0, ""
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
            for line in sse.iter_lines(resp):
                if line.startswith("data: "):
                    chunks += 1
                    last = line if line != "data: [DONE]" else last
                    if chunks == 1:
                        proc.send_signal(signal.SIGTERM)
        # After the drain timeout the request is aborted: its stream ends early with an
        # error event that says why, then [DONE].
        assert chunks < 4000
        error = json.loads(last[6:])["error"]
        assert error["code"] == 503 and "drain-timeout" in error["message"]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
