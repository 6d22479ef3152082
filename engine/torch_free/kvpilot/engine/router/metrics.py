"""The router's own Prometheus metrics (`kvpilot_router_*`), one registry per router."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot.engine.contracts import metric_names as names


class RouterMetrics:
    """Collectors of one router process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(names.ROUTER_REQUESTS, "requests by instance and outcome",
                                ["instance", "outcome"], registry=r)
        self.retries = Counter(names.ROUTER_RETRIES, "attempts retried on another instance "
                               "before the first byte", ["instance"], registry=r)
        self.ejections = Counter(names.ROUTER_EJECTIONS, "instances ejected after failures",
                                 ["instance"], registry=r)
        self.prefix_hit_blocks = Counter(names.ROUTER_PREFIX_HIT_BLOCKS,
                                         "prompt blocks the chosen instance was expected to hold",
                                         registry=r)
        self.prompt_blocks = Counter(names.ROUTER_PROMPT_BLOCKS, "prompt blocks routed",
                                     registry=r)
        self.transferred_blocks = Counter(names.ROUTER_TRANSFERRED_BLOCKS, "KV blocks decode "
                                          "instances pulled from prefill instances", registry=r)
        self.lora_requests = Counter(names.ROUTER_LORA_REQUESTS, "adapter requests by how the "
                                     "replica was chosen: affinity (a holder), overloaded (the "
                                     "holders were too busy) or no_holder", ["outcome"],
                                     registry=r)
        self.in_flight = Gauge(names.ROUTER_IN_FLIGHT, "requests open on each instance",
                               ["instance"], registry=r)
        self.pending = Gauge(names.ROUTER_PENDING_REQUESTS, "requests held waiting for a ready "
                             "instance of a role (demand for scale from zero)", ["role"],
                             registry=r)
        self.healthy = Gauge(names.ROUTER_INSTANCES, "instances by role and state",
                             ["role", "state"], registry=r)
        self.index_entries = Gauge(names.ROUTER_PREFIX_INDEX_ENTRIES,
                                   "(instance, block) entries in the prefix index", registry=r)
        self.migrations = Counter(names.ROUTER_MIGRATIONS, "streams that broke mid-way by "
                                  "reason (upstream_failed, engine_error, drained, stalled) and "
                                  "outcome (resumed on another instance, or failed)",
                                  ["reason", "outcome"], registry=r)
        self.migration_seconds = Histogram(
            names.ROUTER_MIGRATION_SECONDS, "seconds from a stream's break to the first byte of "
            "its continuation on another instance (the pause its client sees, beyond finding "
            "the break: at once for a failed connection, --stall-timeout for a stall)",
            registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.ttfb = Histogram(names.ROUTER_TIME_TO_FIRST_BYTE, "seconds from arrival to the "
                              "first byte sent back", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
