"""Scraping: parsing the engine's real metrics page, p90s from bucket deltas, failures, Prometheus."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from kvpilot.engine.contracts import metric_names as names
from kvpilot.engine.contracts.outputs import EngineStats
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.operator.autoscale.scrape import (
    PodSample,
    parse_metrics,
    pool_metrics,
    prometheus_metrics,
    quantile,
    router_demand,
    scrape,
)


def engine_page(running: int, waiting: int, kv: float, tokens: int,
                ttfts: tuple[float, ...] = (), draining: bool = False,
                startup: float = 0.0) -> str:
    """Gives the metrics page the real engine server renders for these numbers."""
    m = ServerMetrics("tiny-llama")
    m.set_stats(EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=kv,
                            num_waiting_prompt_tokens=tokens, startup_seconds=startup))
    m.set_draining(draining)
    for t in ttfts:
        m.ttft.labels("tiny-llama").observe(t)
    return m.render().decode()


def test_parse_engine_page() -> None:
    sample = parse_metrics(engine_page(3, 2, 0.4, 500, ttfts=(0.03, 0.3, 3.0)), "p0")
    assert sample.gauges[names.NUM_REQUESTS_RUNNING] == 3
    assert sample.gauges[names.NUM_REQUESTS_WAITING] == 2
    assert sample.gauges[names.KV_CACHE_USAGE_PERC] == pytest.approx(0.4)
    assert sample.gauges[names.NUM_WAITING_PROMPT_TOKENS] == 500
    buckets = dict(sample.histograms[names.TIME_TO_FIRST_TOKEN])
    assert (buckets[0.04], buckets[0.5], buckets[5.0], buckets[math.inf]) == (1, 2, 3, 3)


@pytest.mark.parametrize(("q", "buckets", "expected"), [
    (0.9, (), None),
    (0.9, ((1.0, 0.0), (math.inf, 0.0)), None),
    (0.5, ((1.0, 10.0), (2.0, 20.0), (math.inf, 20.0)), 1.0),
    (0.9, ((1.0, 10.0), (2.0, 20.0), (math.inf, 20.0)), 1.8),
    (0.9, ((0.1, 0.0), (1.0, 100.0), (math.inf, 100.0)), 0.91),
    (0.99, ((1.0, 50.0), (math.inf, 100.0)), 1.0),  # beyond the last bound: its value
])
def test_quantile_table(q, buckets, expected) -> None:
    got = quantile(q, buckets)
    assert got == (None if expected is None else pytest.approx(expected))


def test_pool_metrics_sums_gauges_and_takes_p90_of_new_observations() -> None:
    before = {"a": parse_metrics(engine_page(0, 0, 0.0, 0, ttfts=(5.0,) * 100), "a")}
    now = {
        "a": parse_metrics(engine_page(4, 1, 0.5, 100, ttfts=(5.0,) * 100 + (0.03,) * 10,
                                       startup=95.0), "a"),
        "b": parse_metrics(engine_page(2, 3, 0.3, 300, ttfts=(0.03,) * 10, startup=140.5), "b"),
        "c": PodSample("c", error="ConnectTimeout: timed out"),
        "d": parse_metrics(engine_page(9, 9, 0.9, 900, draining=True), "d"),
    }
    m = pool_metrics(now, before, now=100.0, demand=2)
    assert m.replicas_reporting == 2
    assert (m.requests_running, m.requests_waiting, m.waiting_prompt_tokens) == (6, 4, 400)
    assert m.kv_cache_utilization == pytest.approx(0.4)
    assert m.ttft_p90_seconds == pytest.approx(0.038)  # the old 5 s samples are not new
    assert m.itl_p90_seconds is None
    assert m.demand == 2
    assert m.startup_seconds == 140.5  # the slowest engine's start-up, warm-up included


def test_counter_reset_counts_everything_since_restart() -> None:
    before = {"a": parse_metrics(engine_page(0, 0, 0, 0, ttfts=(0.03,) * 50), "a")}
    now = {"a": parse_metrics(engine_page(0, 0, 0, 0, ttfts=(3.0,) * 10), "a")}
    assert pool_metrics(now, before, now=0.0).ttft_p90_seconds == pytest.approx(4.75)


async def test_scrape_is_concurrent_and_bounded_by_timeout() -> None:
    page = engine_page(1, 0, 0.1, 0)

    async def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host == "slow":
            await asyncio.sleep(5)
        if host == "broken":
            return httpx.Response(500, text="boom")
        return httpx.Response(200, text=page)

    targets = {p: f"http://{p}/metrics" for p in ("ok1", "ok2", "slow", "broken")}
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        got = await scrape(targets, timeout_s=0.3, client=client)
        elapsed = loop.time() - start
    assert elapsed < 1.5
    assert {p for p, s in got.items() if s.error is None} == {"ok1", "ok2"}
    assert got["slow"].error.startswith("TimeoutError")
    assert got["broken"].error.startswith("HTTPStatusError")


async def test_router_demand_counts_the_role() -> None:
    page = "\n".join([
        f"# TYPE {names.ROUTER_PENDING_REQUESTS} gauge",
        f'{names.ROUTER_PENDING_REQUESTS}{{role="decode"}} 3.0',
        f'{names.ROUTER_PENDING_REQUESTS}{{role="prefill"}} 1.0', ""])
    transport = httpx.MockTransport(lambda r: httpx.Response(200, text=page))
    async with httpx.AsyncClient(transport=transport) as client:
        urls = ["http://r1/metrics", "http://r2/metrics"]
        assert await router_demand(urls, "decode", client=client) == 6
        assert await router_demand(urls, "both", client=client) == 0


async def test_prometheus_query_endpoint() -> None:
    answers = {"avg(vllm:kv": 0.5, "sum(vllm:num_requests_waiting": 7,
               "sum(vllm:num_requests_running": 12, "sum(kvpilot_num_waiting": 900, "count(": 3}
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        query = request.url.params["query"]
        seen.append(query)
        value = next(v for k, v in answers.items() if query.startswith(k))
        return httpx.Response(200, json={"status": "success", "data": {
            "resultType": "vector", "result": [{"metric": {}, "value": [0, str(value)]}]}})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        m = await prometheus_metrics("http://prom:9090", "ml", 'pod=~"llama-decode-.*"', 5.0,
                                     client=client)
    assert m is not None
    assert (m.replicas_reporting, m.kv_cache_utilization, m.requests_waiting,
            m.requests_running, m.waiting_prompt_tokens) == (3, 0.5, 7, 12, 900)
    assert 'namespace="ml",pod=~"llama-decode-.*"' in seen[0]

    down = httpx.MockTransport(lambda r: httpx.Response(503))
    async with httpx.AsyncClient(transport=down) as client:
        assert await prometheus_metrics("http://prom", "ml", "x", 0.0, client=client) is None
