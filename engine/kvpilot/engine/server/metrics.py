"""Prometheus metrics of one engine server, in vLLM's names, each labelled `model_name`.

Gauges, cumulative counters and the per-step histograms (step seconds, vLLM's
iteration tokens: the core counts them into fixed buckets) are read from the engine
core's latest `EngineStats` snapshot at scrape time (a custom collector), so they never
drift from the engine's own bookkeeping and are never summed over API servers. The
per-request histograms and `request_success` are observed
from the core's deltas as tokens arrive and requests finish, in the API server
that sent the request. With several API server processes (`--api-server-count`)
those are shared through prometheus_client's multiprocess mode
(PROMETHEUS_MULTIPROC_DIR, set by their launcher): a scrape of any of them sums
every process's histograms and counters.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from kvpilot.engine.contracts import metric_names as names
from kvpilot.engine.contracts.outputs import EngineStats
from kvpilot.engine.core.outputs import EngineCoreOutput

# prometheus_client reads it when imported: set it before starting the API server processes
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Buckets follow vLLM's so dashboards built for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM's: 1, 2, 5 times powers of ten up to the longest context served
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class _Progress:
    """What the metrics have seen of one request so far."""

    arrival_time: float
    num_prompt_tokens: int = 0
    num_generated: int = 0
    last_token_time: float | None = None


class _StatsCollector(Collector):
    """Yields the gauges and counters of the latest EngineStats snapshot."""

    def __init__(self, owner: ServerMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        stats, draining = self.owner.snapshot()
        label = [names.MODEL_NAME_LABEL]
        value = [self.owner.model_name]
        gauges = [
            (names.NUM_REQUESTS_RUNNING, "requests in the running batch", stats.num_running),
            (names.NUM_REQUESTS_WAITING, "requests waiting to be scheduled", stats.num_waiting),
            (names.KV_CACHE_USAGE_PERC, "fraction of KV-cache blocks in use (0-1)",
             stats.kv_cache_usage),
            (names.NUM_WAITING_PROMPT_TOKENS, "prompt tokens of waiting requests",
             stats.num_waiting_prompt_tokens),
            (names.DRAINING, "1 while the server drains after SIGTERM", float(draining)),
            (names.KV_HOST_CACHE_USAGE_PERC, "fraction of host-tier KV rows in use (0-1)",
             stats.kv_host_cache_usage),
        ]
        if stats.max_num_seqs:
            gauges.append((names.MAX_NUM_SEQS, "requests the engine runs at once "
                           "(--max-num-seqs)", stats.max_num_seqs))
        for name, doc, number in gauges:
            family = GaugeMetricFamily(name, doc, labels=label)
            family.add_metric(value, float(number))
            yield family
        counters = [
            (names.PREFIX_CACHE_QUERIES, "prompt tokens looked up in the prefix cache",
             stats.prefix_cache_queries),
            (names.PREFIX_CACHE_HITS, "prompt tokens found in the prefix cache",
             stats.prefix_cache_hits),
            (names.EXTERNAL_PREFIX_CACHE_QUERIES, "prompt tokens looked up past the GPU hit "
             "(host tier, pulled KV)", stats.external_prefix_cache_queries),
            (names.EXTERNAL_PREFIX_CACHE_HITS, "prompt tokens loaded from outside the GPU "
             "cache instead of computed", stats.external_prefix_cache_hits),
            (names.NUM_PREEMPTIONS, "preemptions of running requests", stats.num_preemptions),
            (names.PROMPT_TOKENS, "prompt tokens computed", stats.prompt_tokens),
            (names.GENERATION_TOKENS, "tokens generated", stats.generation_tokens),
        ]
        for name, doc, number in counters:
            family = CounterMetricFamily(name, doc, labels=label)
            family.add_metric(value, float(number))
            yield family
        yield from _spec_decode_families(stats, label, value)
        startup = GaugeMetricFamily(names.ENGINE_STARTUP_SECONDS, "seconds from the engine's "
                                    "start to ready: loading, CUDA graphs, warm-up", labels=label)
        startup.add_metric(value, stats.startup_seconds)
        yield startup
        steps = CounterMetricFamily(names.MODEL_STEPS, "model forwards, by graph replay or eager",
                                    labels=[*label, names.MODE_LABEL])
        steps.add_metric([*value, "graph"], float(stats.graph_steps))
        steps.add_metric([*value, stats.mixed_graph_mode], float(stats.piecewise_steps))
        steps.add_metric([*value, "eager"], float(stats.eager_steps))
        yield steps
        step_times = HistogramMetricFamily(
            names.ENGINE_STEP_SECONDS, "engine step wall time by the mode of its forward",
            labels=[*label, names.MODE_LABEL])
        for mode, counts in stats.step_seconds.items():
            bounds = [*map(str, names.STEP_SECONDS_BUCKETS), "+Inf"]
            step_times.add_metric([*value, mode], list(zip(bounds, accumulate(counts),
                                                           strict=True)),
                                  stats.step_seconds_sum.get(mode, 0.0))
        yield step_times
        if stats.iteration_tokens:  # the core's counts: never summed over API servers
            # as vLLM's Histogram writes them: le="1.0", ... (floats)
            bounds = [*(str(float(b)) for b in names.ITERATION_TOKENS_BUCKETS), "+Inf"]
            iteration = HistogramMetricFamily(
                names.ITERATION_TOKENS, "prompt tokens computed plus tokens generated per "
                "engine step", labels=label)
            iteration.add_metric(value, list(zip(bounds, accumulate(stats.iteration_tokens),
                                                  strict=True)), stats.iteration_tokens_sum)
            yield iteration
        offload = CounterMetricFamily(names.KV_OFFLOAD_BLOCKS, "host-tier KV blocks by what "
                                      "happened to them", labels=[*label, names.OP_LABEL])
        for op, number in (("saved", stats.kv_offload_saved_blocks),
                           ("loaded", stats.kv_offload_loaded_blocks),
                           ("failed", stats.kv_offload_failed_blocks),
                           ("dropped", stats.kv_offload_dropped_blocks),
                           ("evicted", stats.kv_offload_evicted_blocks)):
            offload.add_metric([*value, op], float(number))
        yield offload
        yield from _transport_families(stats, label, value)
        if stats.block_size:
            info = GaugeMetricFamily(names.CACHE_CONFIG_INFO, "KV-cache layout, in its labels",
                                     labels=[*label, names.BLOCK_SIZE_LABEL,
                                             names.NUM_GPU_BLOCKS_LABEL])
            info.add_metric([*value, str(stats.block_size), str(stats.num_total_blocks)], 1.0)
            yield info
        if stats.max_lora:
            yield _lora_info(stats)


def _lora_info(stats: EngineStats) -> Metric:
    """Gives vLLM's LoRA info gauge: the adapters in its labels, the time as its value."""
    family = GaugeMetricFamily(names.LORA_REQUESTS_INFO, "running and waiting LoRA adapters",
                               labels=[names.RUNNING_LORA_ADAPTERS_LABEL,
                                       names.WAITING_LORA_ADAPTERS_LABEL, names.MAX_LORA_LABEL])
    family.add_metric([",".join(stats.running_lora_adapters),
                       ",".join(stats.waiting_lora_adapters), str(stats.max_lora)], time.time())
    return family


def _transport_families(stats: EngineStats, label: list[str], value: list[str]
                        ) -> Iterator[Metric]:
    """Yields a role engine's KV transport and its pulls by transport (nothing for `both`)."""
    if not stats.kv_transport:
        return
    info = GaugeMetricFamily(names.KV_TRANSPORT_INFO, "the KV transport this engine's agent "
                             "uses, in its label", labels=[*label, names.TRANSPORT_LABEL])
    info.add_metric([*value, stats.kv_transport], 1.0)
    yield info
    pulls = CounterMetricFamily(names.KV_PULLS, "KV pulls completed, by the transport that "
                                "moved their blocks", labels=[*label, names.TRANSPORT_LABEL])
    for transport, number in sorted(stats.kv_pulls.items()):
        pulls.add_metric([*value, transport], float(number))
    yield pulls


def _spec_decode_families(stats: EngineStats, label: list[str], value: list[str]
                          ) -> Iterator[Metric]:
    """Yields vLLM's spec_decode counters, when the engine speculates (per_pos is non-empty)."""
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    if not per_pos:
        return
    for name, doc, number in (
            (names.SPEC_DECODE_NUM_DRAFTS, "verifications with draft tokens",
             stats.spec_decode_num_drafts),
            (names.SPEC_DECODE_NUM_DRAFT_TOKENS, "draft tokens proposed",
             stats.spec_decode_num_draft_tokens),
            (names.SPEC_DECODE_NUM_ACCEPTED_TOKENS, "draft tokens accepted",
             stats.spec_decode_num_accepted_tokens)):
        family = CounterMetricFamily(name, doc, labels=label)
        family.add_metric(value, float(number))
        yield family
    family = CounterMetricFamily(names.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
                                 "draft tokens accepted, by position in the draft",
                                 labels=[*label, names.POSITION_LABEL])
    for pos, number in enumerate(per_pos):
        family.add_metric([*value, str(pos)], float(number))
    yield family


class ServerMetrics:
    """The server's Prometheus registry and the observers its core client calls."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._stats = EngineStats()
        self._draining = False
        self._progress: dict[str, _Progress] = {}
        self.registry.register(_StatsCollector(self))
        # in multiprocess mode each process's values live in files the collector sums
        own: CollectorRegistry | None = self.registry
        if os.environ.get(MULTIPROC_DIR_ENV):
            MultiProcessCollector(self.registry)
            own = None
        label = [names.MODEL_NAME_LABEL]
        self.request_success = Counter(
            names.REQUEST_SUCCESS, "finished requests by finish reason",
            [names.MODEL_NAME_LABEL, names.FINISHED_REASON_LABEL], registry=own)
        self.ttft = Histogram(names.TIME_TO_FIRST_TOKEN, "seconds from arrival to first token",
                              label, buckets=TTFT_BUCKETS, registry=own)
        self.itl = Histogram(names.INTER_TOKEN_LATENCY, "seconds between output tokens",
                             label, buckets=ITL_BUCKETS, registry=own)
        self.e2e = Histogram(names.E2E_REQUEST_LATENCY, "seconds from arrival to finish",
                             label, buckets=LATENCY_BUCKETS, registry=own)
        self.queue_time = Histogram(names.REQUEST_QUEUE_TIME,
                                    "seconds from arrival to first scheduling", label,
                                    buckets=LATENCY_BUCKETS, registry=own)
        self.request_prompt_tokens = Histogram(
            names.REQUEST_PROMPT_TOKENS, "prompt tokens of each finished request", label,
            buckets=TOKEN_BUCKETS, registry=own)
        self.request_generation_tokens = Histogram(
            names.REQUEST_GENERATION_TOKENS, "tokens generated by each finished request",
            label, buckets=TOKEN_BUCKETS, registry=own)
        self.tpot = Histogram(names.TIME_PER_OUTPUT_TOKEN, "seconds between output tokens "
                              "(vLLM's older name of inter_token_latency)", label,
                              buckets=ITL_BUCKETS, registry=own)
        # the per-token observers, labelled once: `labels()` costs a lock and a dict lookup
        self._ttft = self.ttft.labels(model_name)
        self._itl = self.itl.labels(model_name)
        self._tpot = self.tpot.labels(model_name)

    def snapshot(self) -> tuple[EngineStats, bool]:
        """Gives the latest engine stats and whether the server is draining."""
        with self._lock:
            return self._stats, self._draining

    def set_stats(self, stats: EngineStats) -> None:
        with self._lock:
            self._stats = stats

    def set_draining(self, draining: bool) -> None:
        with self._lock:
            self._draining = draining

    def on_added(self, request_id: str, arrival_time: float, num_prompt_tokens: int = 0) -> None:
        """Starts tracking a request the engine accepted."""
        self._progress[request_id] = _Progress(arrival_time, num_prompt_tokens)

    def on_output(self, output: EngineCoreOutput, now: float | None = None) -> None:
        """Observes TTFT/ITL for the tokens new in the delta `output`, and the finish metrics."""
        progress = self._progress.get(output.request_id)
        if progress is None:
            return
        now = time.monotonic() if now is None else now
        m = output.metrics
        num_new = sum(len(c.token_ids) for c in output.completions)
        progress.num_generated += num_new
        if num_new:
            if progress.last_token_time is None:
                first = m.first_token_time if m and m.first_token_time else now
                self._ttft.observe(max(0.0, first - progress.arrival_time))
                progress.last_token_time = first
            else:
                # One sample per step that produced tokens, as vLLM does.
                gap = max(0.0, now - progress.last_token_time)
                self._itl.observe(gap)
                self._tpot.observe(gap)
                progress.last_token_time = now
        if output.finished:
            reason = next((c.finish_reason for c in output.completions if c.finish_reason),
                          "stop")
            if output.error:
                reason = "error"
            self._finish(output.request_id, reason, now, m.first_scheduled_time if m else None)

    def on_aborted(self, request_id: str, now: float | None = None) -> None:
        """Counts a request the server aborted (client gone, drain timeout)."""
        if request_id in self._progress:
            self._finish(request_id, "abort", time.monotonic() if now is None else now, None)

    def _finish(self, request_id: str, reason: str, now: float,
                first_scheduled: float | None) -> None:
        progress = self._progress.pop(request_id)
        self.request_success.labels(self.model_name, reason).inc()
        self.request_prompt_tokens.labels(self.model_name).observe(progress.num_prompt_tokens)
        self.request_generation_tokens.labels(self.model_name).observe(progress.num_generated)
        self.e2e.labels(self.model_name).observe(max(0.0, now - progress.arrival_time))
        if first_scheduled is not None:
            self.queue_time.labels(self.model_name).observe(
                max(0.0, first_scheduled - progress.arrival_time))

    def render(self) -> bytes:
        """Gives the text exposition of every metric."""
        return generate_latest(self.registry)
