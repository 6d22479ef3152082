"""Invariants of the HTTP layer over the real engine, checked on generated inputs."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import sse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import MODEL, RunningServer

from kvpilot.cli.main import main

PROMPTS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
                  min_size=1, max_size=40)


def streamed(server: RunningServer, body: dict) -> tuple[dict[int, str], dict | None]:
    """Gives the text per choice index rebuilt from SSE deltas, and the usage chunk."""
    texts: dict[int, str] = {}
    usage = None
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      json={**body, "stream": True,
                            "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        for line in sse.iter_lines(resp):
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                usage = chunk.get("usage") or usage
    return texts, usage


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=PROMPTS, max_tokens=st.integers(1, 8), n=st.integers(1, 2),
       seed=st.integers(0, 2**31))
def test_stream_deltas_rebuild_the_whole_response(server: RunningServer, prompt: str,
                                                  max_tokens: int, n: int, seed: int) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "n": n,
            "seed": seed, "temperature": 1.0}
    whole = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
    texts, usage = streamed(server, body)
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert usage is not None
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    # cached_tokens may differ: the second request finds the first one's prefix blocks.
    assert {k: usage[k] for k in counts} == {k: whole["usage"][k] for k in counts}
    assert 1 <= whole["usage"]["completion_tokens"] <= n * max_tokens


@pytest.mark.parametrize(("flags", "message"), [
    (["--block-size", "0"], "block_size=0 is invalid"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization=1.5 is invalid"),
    (["--kv-cache-memory", "lots"], "kv_cache_memory='lots' is not a size"),
])
def test_serve_refuses_bad_flags_before_loading(flags: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "tiny-llama", *flags]) == 2
    assert message in capsys.readouterr().err
