"""Flow control's Prometheus metrics, per flow and priority band, on the router's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot.engine.contracts import metric_names as names

FLOW_LABELS_MAX = 64  # flows with a label of their own; a fairness id is client-chosen
OTHER_FLOW = "other"


class FlowMetrics:
    """Queue length, queue time and outcomes by flow and band."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = [names.FLOW_LABEL, names.PRIORITY_LABEL]
        self.queued = Gauge(names.ROUTER_FLOW_QUEUED, "requests waiting in the router's flow "
                            "queue (every replica saturated)", labels, registry=registry)
        self.queue_time = Histogram(names.ROUTER_FLOW_QUEUE_TIME, "seconds a request waited in "
                                    "the flow queue before dispatch", labels, registry=registry,
                                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                                             5, 10, 30, 60))
        self.requests = Counter(names.ROUTER_FLOW_REQUESTS, "requests through flow control by "
                                "outcome: dispatched, shed (429, queue full), timeout (429, "
                                "queue time-out), unmeetable (429, no replica meets its SLO), "
                                "disconnected (client left while queued)",
                                [*labels, "outcome"], registry=registry)
        self._flows: set[str] = set()

    def flow_label(self, flow: str) -> str:
        """Gives the label value of `flow`: itself for the first FLOW_LABELS_MAX flows."""
        if flow in self._flows:
            return flow
        if len(self._flows) < FLOW_LABELS_MAX:
            self._flows.add(flow)
            return flow
        return OTHER_FLOW

    def outcome(self, flow: str, priority: int, outcome: str, waited: float | None) -> None:
        """Counts a request's outcome; `waited` (seconds) when it was dispatched."""
        labels = (self.flow_label(flow), str(priority))
        self.requests.labels(*labels, outcome).inc()
        if waited is not None:
            self.queue_time.labels(*labels).observe(waited)

    def queue_changed(self, flow: str, priority: int, delta: int) -> None:
        """Adds `delta` to the queue length of `flow` in band `priority`."""
        self.queued.labels(self.flow_label(flow), str(priority)).inc(delta)
