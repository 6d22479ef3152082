"""Reading a pool's load: its ready pods' `/metrics` (concurrently, with timeouts) or Prometheus.

Each pod's Prometheus text is parsed with `prometheus_client.parser`; a pool's
sample sums the pods' gauges, averages their KV-cache usage and takes p90 TTFT
and ITL from the histogram buckets observed since the previous scrape. A pod
that times out or answers badly simply does not report: the policy treats the
gap as missing data, which never scales the pool down.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from kvpilot.engine.contracts import metric_names as names
from kvpilot.engine.contracts.metrics_text import read_metrics
from kvpilot.operator.autoscale.signals import PoolMetrics

GAUGES = (names.KV_CACHE_USAGE_PERC, names.NUM_REQUESTS_WAITING, names.NUM_REQUESTS_RUNNING,
          names.NUM_WAITING_PROMPT_TOKENS, names.DRAINING, names.ROUTER_PENDING_REQUESTS,
          names.ENGINE_STARTUP_SECONDS)
HISTOGRAMS = (names.TIME_TO_FIRST_TOKEN, names.INTER_TOKEN_LATENCY)
Buckets = tuple[tuple[float, float], ...]
"""Cumulative (upper bound, count) pairs, ascending, ending with +Inf."""


@dataclass(frozen=True)
class PodSample:
    """One pod's scrape: gauge values summed over label sets, histogram buckets, or the error."""

    pod: str
    gauges: Mapping[str, float] = field(default_factory=dict)
    histograms: Mapping[str, Buckets] = field(default_factory=dict)
    error: str | None = None


def parse_metrics(text: str, pod: str = "",
                  labels: Mapping[str, str] | None = None) -> PodSample:
    """Gives the gauges and histograms kvpilot reads from one Prometheus text page.

    Only samples whose labels include `labels` count (e.g. {"role": "decode"}
    on the router's page).
    """
    gauges, buckets = read_metrics(text, GAUGES, HISTOGRAMS, labels)
    histograms = {name: tuple(sorted(per.items())) for name, per in buckets.items()}
    return PodSample(pod, gauges, histograms)


async def scrape(targets: Mapping[str, str], timeout_s: float = 2.0,
                 client: httpx.AsyncClient | None = None,
                 labels: Mapping[str, str] | None = None) -> dict[str, PodSample]:
    """Gives each target's sample ({pod: url}), all fetched at once; failures carry `error`."""
    own = client is None
    http = client or httpx.AsyncClient(timeout=timeout_s)

    async def one(pod: str, url: str) -> PodSample:
        try:
            response = await asyncio.wait_for(http.get(url), timeout_s)
            response.raise_for_status()
            return parse_metrics(response.text, pod, labels)
        except (httpx.HTTPError, TimeoutError, ValueError, KeyError) as exc:
            return PodSample(pod, error=f"{type(exc).__name__}: {exc}"[:200])

    try:
        results = await asyncio.gather(*(one(pod, url) for pod, url in targets.items()))
    finally:
        if own:
            await http.aclose()
    return {s.pod: s for s in results}


def quantile(q: float, buckets: Buckets) -> float | None:
    """Gives the q-quantile of cumulative buckets as Prometheus' histogram_quantile does."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _delta(now: Buckets, before: Buckets | None) -> Buckets:
    """Gives the observations between two scrapes (all of `now` after a restart's reset)."""
    if not before or len(before) != len(now) or now[-1][1] < before[-1][1]:
        return now
    return tuple((b, c - p) for (b, c), (_, p) in zip(now, before, strict=True))


def _merge(parts: Sequence[Buckets]) -> Buckets:
    total: dict[float, float] = {}
    for part in parts:
        for bound, count in part:
            total[bound] = total.get(bound, 0.0) + count
    return tuple(sorted(total.items()))


def pool_metrics(samples: Mapping[str, PodSample], previous: Mapping[str, PodSample],
                 now: float, demand: int = 0) -> PoolMetrics:
    """Gives the pool's PoolMetrics from its pods' samples (and the previous ones for p90s)."""
    ok = [s for s in samples.values() if s.error is None and not s.gauges.get(names.DRAINING)]

    def total(name: str) -> float | None:
        values = [s.gauges[name] for s in ok if name in s.gauges]
        return sum(values) if len(values) == len(ok) and ok else None

    kv = total(names.KV_CACHE_USAGE_PERC)

    def p90(name: str) -> float | None:
        parts = [_delta(s.histograms[name], previous.get(s.pod, PodSample("")).histograms.get(name))
                 for s in ok if name in s.histograms]
        return quantile(0.9, _merge(parts)) if parts else None

    return PoolMetrics(
        time=now, replicas_reporting=len(ok),
        kv_cache_utilization=None if kv is None else kv / len(ok),
        requests_waiting=total(names.NUM_REQUESTS_WAITING),
        requests_running=total(names.NUM_REQUESTS_RUNNING),
        waiting_prompt_tokens=total(names.NUM_WAITING_PROMPT_TOKENS),
        ttft_p90_seconds=p90(names.TIME_TO_FIRST_TOKEN),
        itl_p90_seconds=p90(names.INTER_TOKEN_LATENCY),
        demand=demand,
        startup_seconds=max((s.gauges[names.ENGINE_STARTUP_SECONDS] for s in ok
                             if names.ENGINE_STARTUP_SECONDS in s.gauges), default=None))


async def router_demand(router_urls: Sequence[str], role: str, timeout_s: float = 2.0,
                        client: httpx.AsyncClient | None = None) -> int:
    """Gives the requests the routers hold for `role` because no replica of it is ready."""
    samples = await scrape({url: url for url in router_urls}, timeout_s, client,
                           labels={"role": role})
    return int(sum(s.gauges.get(names.ROUTER_PENDING_REQUESTS, 0.0) for s in samples.values()))


PROMQL = {
    "kv": ("avg", names.KV_CACHE_USAGE_PERC),
    "waiting": ("sum", names.NUM_REQUESTS_WAITING),
    "running": ("sum", names.NUM_REQUESTS_RUNNING),
    "tokens": ("sum", names.NUM_WAITING_PROMPT_TOKENS),
    "pods": ("count", names.NUM_REQUESTS_RUNNING),
}
"""Each PoolMetrics field's (aggregation, metric) over the pool's pods."""


async def prometheus_metrics(base_url: str, namespace: str, pod_selector: str, now: float,
                             timeout_s: float = 5.0,
                             client: httpx.AsyncClient | None = None) -> PoolMetrics | None:
    """Gives the pool's PoolMetrics from a Prometheus query API (None when it cannot answer).

    `pod_selector` is a PromQL label matcher of the pool's pods, e.g. `pod=~"llama-decode-.*"`.
    """
    own = client is None
    http = client or httpx.AsyncClient(timeout=timeout_s)
    try:
        values: dict[str, float | None] = {}
        for key, (aggregation, metric) in PROMQL.items():
            query = f'{aggregation}({metric}{{namespace="{namespace}",{pod_selector}}})'
            response = await http.get(f"{base_url.rstrip('/')}/api/v1/query",
                                      params={"query": query})
            response.raise_for_status()
            result = response.json()["data"]["result"]
            values[key] = float(result[0]["value"][1]) if result else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None
    finally:
        if own:
            await http.aclose()
    return PoolMetrics(time=now, replicas_reporting=int(values["pods"] or 0),
                       kv_cache_utilization=values["kv"], requests_waiting=values["waiting"],
                       requests_running=values["running"], waiting_prompt_tokens=values["tokens"])
