"""/metrics moves as expected under a known workload, and a client disconnect frees its request."""

from __future__ import annotations

import httpx
import pytest
from helpers import sse
from server_harness import MODEL, RunningServer, wait_for

from kvpilot.engine.contracts import metric_names as names

MAX_TOKENS = 5
PROMPTS = ["alpha", "beta gamma", "delta epsilon zeta"]  # distinct and under one block


def complete(server: RunningServer, prompt: str, stream: bool = False, **extra: object) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": stream, **extra}
    if not stream:
        resp = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()
    body["stream_options"] = {"include_usage": True}
    usage = None
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        for line in sse.iter_lines(r):
            if line.startswith("data: {") and '"usage":{' in line:
                usage = httpx.Response(200, content=line[6:]).json()["usage"]
    assert usage is not None
    return {"usage": usage}


def histogram_count(server: RunningServer, name: str) -> float:
    return server.metric(f"{name}_count")


def test_metrics_count_a_known_workload(server: RunningServer) -> None:
    idle_kv = server.metric(names.KV_CACHE_USAGE_PERC)
    assert server.metric(names.NUM_REQUESTS_RUNNING) == 0
    assert server.metric(names.NUM_REQUESTS_WAITING) == 0
    # The engine is shared by the session, so its counters are read as deltas;
    # histograms and request_success belong to this module's fresh app.
    generated = server.metric(f"{names.GENERATION_TOKENS}_total")
    computed = server.metric(f"{names.PROMPT_TOKENS}_total")
    eager = server.metric(f"{names.MODEL_STEPS}_total", mode="eager")
    steps = {le: server.metric(f"{names.ITERATION_TOKENS}_bucket", le=le)
             for le in ("1.0", "+Inf")}
    step_tokens = server.metric(f"{names.ITERATION_TOKENS}_sum")
    assert histogram_count(server, names.TIME_TO_FIRST_TOKEN) == 0

    usages = [complete(server, p, stream=(i == 2))["usage"] for i, p in enumerate(PROMPTS)]
    n = len(PROMPTS)
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    assert all(u["completion_tokens"] == MAX_TOKENS for u in usages)
    assert server.metric(f"{names.GENERATION_TOKENS}_total") - generated == n * MAX_TOKENS
    assert server.metric(f"{names.PROMPT_TOKENS}_total") - computed == prompt_tokens
    # one forward per token, one request at a time; CPU runs no CUDA graphs
    assert server.metric(f"{names.MODEL_STEPS}_total", mode="eager") - eager == n * MAX_TOKENS
    assert server.metric(f"{names.MODEL_STEPS}_total", mode="graph") == 0
    # vLLM's tokens per engine step (issue 49: missing), from the core's counts: each
    # request's prefill step computes its prompt and samples a token, each later step one
    assert (server.metric(f"{names.ITERATION_TOKENS}_bucket", le="+Inf") - steps["+Inf"]
            == n * MAX_TOKENS)
    assert (server.metric(f"{names.ITERATION_TOKENS}_bucket", le="1.0") - steps["1.0"]
            == n * (MAX_TOKENS - 1))
    assert (server.metric(f"{names.ITERATION_TOKENS}_sum") - step_tokens
            == prompt_tokens + n * MAX_TOKENS)
    assert server.metric(f"{names.REQUEST_SUCCESS}_total", finished_reason="length") == n
    assert histogram_count(server, names.TIME_TO_FIRST_TOKEN) == n
    assert histogram_count(server, names.E2E_REQUEST_LATENCY) == n
    assert histogram_count(server, names.REQUEST_QUEUE_TIME) == n
    # One inter-token sample per token after the first.
    assert histogram_count(server, names.INTER_TOKEN_LATENCY) == n * (MAX_TOKENS - 1)
    # vLLM's per-request token histograms and the older ITL name (issue 49: missing)
    assert histogram_count(server, names.TIME_PER_OUTPUT_TOKEN) == n * (MAX_TOKENS - 1)
    assert histogram_count(server, names.REQUEST_PROMPT_TOKENS) == n
    assert server.metric(f"{names.REQUEST_PROMPT_TOKENS}_sum") == prompt_tokens
    assert histogram_count(server, names.REQUEST_GENERATION_TOKENS) == n
    assert server.metric(f"{names.REQUEST_GENERATION_TOKENS}_sum") == n * MAX_TOKENS
    assert server.metric(f"{names.E2E_REQUEST_LATENCY}_sum") > 0
    assert server.metric(names.NUM_REQUESTS_RUNNING) == 0
    assert server.metric(names.KV_CACHE_USAGE_PERC) == idle_kv
    assert server.metric(names.DRAINING) == 0


def test_prefix_cache_hits_match_cached_tokens(server: RunningServer) -> None:
    prompt = " ".join(f"word{i}" for i in range(40))  # several full blocks
    hits_before = server.metric(f"{names.PREFIX_CACHE_HITS}_total")
    queries_before = server.metric(f"{names.PREFIX_CACHE_QUERIES}_total")
    complete(server, prompt)
    second = complete(server, prompt)["usage"]
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16
    assert server.metric(f"{names.PREFIX_CACHE_HITS}_total") - hits_before == cached
    assert server.metric(f"{names.PREFIX_CACHE_QUERIES}_total") - queries_before >= cached


def test_disconnected_stream_is_aborted_and_frees_its_blocks(server: RunningServer) -> None:
    idle_kv = server.metric(names.KV_CACHE_USAGE_PERC)
    aborts_before = server.metric(f"{names.REQUEST_SUCCESS}_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        lines = sse.iter_lines(r)
        received = [line for _, line in zip(range(6), lines, strict=False)]
        assert any(line.startswith("data: {") for line in received)
        assert server.metric(names.NUM_REQUESTS_RUNNING) == 1
        assert server.metric(names.KV_CACHE_USAGE_PERC) > idle_kv
    # Leaving the block closed the connection mid-stream.
    assert wait_for(lambda: server.metric(names.NUM_REQUESTS_RUNNING) == 0)
    assert wait_for(lambda: server.metric(names.KV_CACHE_USAGE_PERC) == idle_kv)
    assert server.metric(f"{names.REQUEST_SUCCESS}_total",
                         finished_reason="abort") == aborts_before + 1


def test_disconnected_non_streaming_request_is_aborted(server: RunningServer) -> None:
    idle_kv = server.metric(names.KV_CACHE_USAGE_PERC)
    aborts_before = server.metric(f"{names.REQUEST_SUCCESS}_total", finished_reason="abort")
    # 3 x 480 tokens cannot finish within the client's 0.5 s, however fast the CPU.
    body = {"model": MODEL, "prompt": "another long story", "max_tokens": 480, "n": 3,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.5)
    assert wait_for(lambda: server.metric(f"{names.REQUEST_SUCCESS}_total",
                                          finished_reason="abort") == aborts_before + 1)
    assert wait_for(lambda: server.metric(names.NUM_REQUESTS_RUNNING) == 0)
    assert wait_for(lambda: server.metric(names.KV_CACHE_USAGE_PERC) == idle_kv)


def test_cache_config_info_carries_what_gateway_endpoint_pickers_read(
        server: RunningServer) -> None:
    """The Gateway API inference extension's pickers read block_size (prefix scorer) and
    num_gpu_blocks from vllm:cache_config_info's labels, beside queue and KV gauges."""
    found = {dict(labels).get(names.BLOCK_SIZE_LABEL): dict(labels)
             for (name, labels), value in server.metrics().items()
             if name == names.CACHE_CONFIG_INFO and value == 1}
    assert len(found) == 1, found
    labels = next(iter(found.values()))
    assert int(labels[names.BLOCK_SIZE_LABEL]) > 0
    assert int(labels[names.NUM_GPU_BLOCKS_LABEL]) > 0
    assert labels[names.MODEL_NAME_LABEL] == MODEL
