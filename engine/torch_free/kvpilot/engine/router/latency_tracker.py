"""Predicted-latency placement's shell: the pool's model, each replica's live load, and the
trip of one request through them (the load it adds, the TTFT and TPOT samples it gives back)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.responses import AsyncContentStream, Content

from kvpilot.engine.contracts import metric_names as names
from kvpilot.engine.contracts.router_objectives import PREDICTED_TTFT_HEADER
from kvpilot.engine.router.flow_control import Admission
from kvpilot.engine.router.flow_ticket import FlowTicket
from kvpilot.engine.router.latency_model import PoolModel, TpotFeatures, TtftFeatures
from kvpilot.engine.router.latency_placement import Prediction


@dataclass
class ReplicaState:
    """What the router has on a replica now."""

    prefilling_tokens: float = 0.0  # new prompt tokens of its requests not streaming yet
    decoding: int = 0  # its requests streaming

    def ttft_features(self, new_tokens: float) -> TtftFeatures:
        return TtftFeatures(new_tokens, self.prefilling_tokens, self.decoding)


class LatencyModels:
    """The pool's model, every replica's state, and the metrics that explain the model."""

    def __init__(self, min_samples: int, registry: CollectorRegistry) -> None:
        self.min_samples = min_samples
        self.model = PoolModel()
        self.replicas: dict[str, ReplicaState] = {}
        self.coefficient = Gauge(names.ROUTER_LATENCY_MODEL_COEFFICIENT, "the pool's latency "
                                 "model, term by term, on a replica of speed 1: seconds per "
                                 "request, per 1,000 tokens or per request on the replica",
                                 ["target", "term"], registry=registry)
        self.speed = Gauge(names.ROUTER_LATENCY_MODEL_SPEED, "how much slower than the pool's "
                           "model a replica runs now (its predictions' multiplier)",
                           ["instance", "target"], registry=registry)
        self.samples = Gauge(names.ROUTER_LATENCY_MODEL_SAMPLES, "requests the latency model "
                             "learnt from, by the replica that served them",
                             ["instance", "target"], registry=registry)
        self.slo = Counter(names.ROUTER_SLO_REQUESTS, "streamed requests with a TTFT objective "
                           "by outcome: met or missed (time to first byte at the router)",
                           ["outcome"], registry=registry)

    def state(self, url: str) -> ReplicaState:
        return self.replicas.setdefault(url, ReplicaState())

    def keep(self, urls: Iterable[str]) -> None:
        """Forgets the replicas not in `urls` (they left the fleet)."""
        wanted = set(urls)
        for url in [u for u in self.replicas if u not in wanted]:
            del self.replicas[url]
            self.model.forget(url)
            for target in ("ttft", "tpot"):
                for gauge in (self.samples, self.speed):
                    with contextlib.suppress(KeyError):  # it never served a stream
                        gauge.remove(url, target)

    def warm(self, urls: Iterable[str]) -> bool:
        """Gives whether the model predicts for these replicas (`PoolModel.warm`)."""
        return self.model.warm(self.min_samples, urls)

    def predict(self, url: str, new_tokens: float, context_tokens: float) -> Prediction:
        state = self.state(url)
        return Prediction(url, self.model.predict_ttft(url, state.ttft_features(new_tokens)),
                          self.model.predict_tpot(url, TpotFeatures(state.decoding + 1,
                                                                    context_tokens)))

    def observe_ttft(self, url: str, features: TtftFeatures, ttft: float) -> None:
        self.model.observe_ttft(url, features, ttft)
        self.samples.labels(url, "ttft").inc()
        self.export()

    def observe_tpot(self, url: str, features: TpotFeatures, tpot: float) -> None:
        self.model.observe_tpot(url, features, tpot)
        self.samples.labels(url, "tpot").inc()
        self.export()

    def export(self) -> None:
        for target, fit in (("ttft", self.model.ttft), ("tpot", self.model.tpot)):
            for term, value in fit.coefficients().items():
                self.coefficient.labels(target, term).set(value)
        for url, speed in self.model.speeds.items():
            self.speed.labels(url, "ttft").set(speed.ttft)
            self.speed.labels(url, "tpot").set(speed.tpot)


class RequestLatency:
    """One request's trip: `started` on each replica tried, `finish` with its response."""

    def __init__(self, models: LatencyModels, ticket: FlowTicket, prompt_tokens: float,
                 output_tokens: float, stream: bool, admission: Admission) -> None:
        self.models, self.ticket, self.admission = models, ticket, admission
        self.prompt_tokens, self.output_tokens, self.stream = prompt_tokens, output_tokens, stream
        self.url: str | None = None
        self.new_tokens = 0.0
        self.features: TtftFeatures | None = None
        self.prediction: Prediction | None = None
        self.sent = 0.0

    @property
    def context_tokens(self) -> float:
        return self.prompt_tokens + self.output_tokens / 2

    def started(self, url: str, new_tokens: float, prediction: Prediction | None) -> None:
        """Notes that `url` took the request (an earlier attempt failed before its first byte)."""
        self.admission.begun()
        self._prefilled()
        state = self.models.state(url)
        self.url, self.new_tokens, self.prediction = url, new_tokens, prediction
        self.features = state.ttft_features(new_tokens)
        state.prefilling_tokens += new_tokens
        self.sent = time.monotonic()

    def _prefilled(self) -> None:
        if self.url is not None and self.url in self.models.replicas:
            state = self.models.replicas[self.url]
            state.prefilling_tokens = max(0.0, state.prefilling_tokens - self.new_tokens)
        self.new_tokens = 0.0

    def finish(self, response: Response) -> Response:
        """Gives `response`, observed: a stream's first byte is a TTFT sample, its events
        TPOT samples; the replica's load drops as the request moves on; flow control's
        admission ends with the response."""
        response = self.admission.watch(response)
        url, features = self.url, self.features
        self._prefilled()
        if url is None or features is None:
            return response
        if self.prediction is not None:
            response.headers[PREDICTED_TTFT_HEADER] = f"{self.prediction.ttft_s * 1000:.1f}"
        if not (self.stream and isinstance(response, StreamingResponse)
                and response.status_code == 200 and url in self.models.replicas):
            return response
        ttft = time.monotonic() - self.sent
        state = self.models.replicas[url]
        self.models.observe_ttft(url, features, ttft)
        if self.ticket.ttft_slo_s is not None:
            self.models.slo.labels("met" if ttft <= self.ticket.ttft_slo_s else "missed").inc()
        tpot = TpotFeatures(state.decoding + 1, self.context_tokens)
        state.decoding += 1
        response.body_iterator = self._observe(response.body_iterator, url, state, tpot)
        return response

    async def _observe(self, chunks: AsyncContentStream, url: str, state: ReplicaState,
                       tpot: TpotFeatures) -> AsyncIterator[Content]:
        """Relays the stream, counting its events for a TPOT sample at its end."""
        events, first, last = 0, 0.0, 0.0
        try:
            async for chunk in chunks:
                data = chunk.encode() if isinstance(chunk, str) else chunk if isinstance(
                    chunk, bytes) else bytes(chunk)
                count = data.count(b"data: ") - data.count(b"data: [DONE]")
                if count:
                    last = time.monotonic()
                    first = first or last
                    events += count
                yield chunk
        finally:
            state.decoding = max(0, state.decoding - 1)
            if events >= 2 and url in self.models.replicas:
                self.models.observe_tpot(url, tpot, (last - first) / (events - 1))
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()
