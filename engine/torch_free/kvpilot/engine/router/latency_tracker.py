"""Predicted-latency placement's shell: each replica's models and live load, and the trip of
one request through them (the load it adds, the TTFT and TPOT samples it gives back)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.responses import AsyncContentStream, Content

from kvpilot.engine.contracts import metric_names as names
from kvpilot.engine.contracts.router_objectives import PREDICTED_TTFT_HEADER
from kvpilot.engine.router.flow_control import Admission
from kvpilot.engine.router.flow_ticket import FlowTicket
from kvpilot.engine.router.latency_model import ReplicaModel, TpotFeatures, TtftFeatures
from kvpilot.engine.router.latency_placement import Prediction


@dataclass
class ReplicaState:
    """A replica's models and what the router has on it now."""

    model: ReplicaModel = field(default_factory=ReplicaModel)
    prefilling_tokens: float = 0.0  # new prompt tokens of its requests not streaming yet
    decoding: int = 0  # its requests streaming

    def ttft_features(self, new_tokens: float) -> TtftFeatures:
        return TtftFeatures(new_tokens, self.prefilling_tokens, self.decoding)


class LatencyModels:
    """Every replica's state, and the metrics that explain the models."""

    def __init__(self, min_samples: int, registry: CollectorRegistry) -> None:
        self.min_samples = min_samples
        self.replicas: dict[str, ReplicaState] = {}
        self.coefficient = Gauge(names.ROUTER_LATENCY_MODEL_COEFFICIENT, "a replica's latency "
                                 "model, term by term: seconds per request, per 1,000 tokens or "
                                 "per request on the replica", ["instance", "target", "term"],
                                 registry=registry)
        self.samples = Gauge(names.ROUTER_LATENCY_MODEL_SAMPLES, "requests a replica's latency "
                             "model learnt from", ["instance", "target"], registry=registry)
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
            for target in ("ttft", "tpot"):
                self.samples.remove(url, target)

    def warm(self, urls: Iterable[str]) -> bool:
        """Gives whether every one of these replicas' TTFT models is warm."""
        return all(self.state(url).model.warm(self.min_samples) for url in urls)

    def predict(self, url: str, new_tokens: float, context_tokens: float) -> Prediction:
        state = self.state(url)
        return Prediction(url, state.model.predict_ttft(state.ttft_features(new_tokens)),
                          state.model.predict_tpot(TpotFeatures(state.decoding + 1,
                                                                context_tokens)))

    def export(self, url: str) -> None:
        model = self.state(url).model
        for target, fit in (("ttft", model.ttft), ("tpot", model.tpot)):
            self.samples.labels(url, target).set(fit.samples)
            for term, value in fit.coefficients().items():
                self.coefficient.labels(url, target, term).set(value)


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
        state.model.ttft.update(features.vector(), ttft)
        if self.ticket.ttft_slo_s is not None:
            self.models.slo.labels("met" if ttft <= self.ticket.ttft_slo_s else "missed").inc()
        tpot = TpotFeatures(state.decoding + 1, self.context_tokens)
        state.decoding += 1
        self.models.export(url)
        response.body_iterator = self._observe(response.body_iterator, state, tpot)
        return response

    async def _observe(self, chunks: AsyncContentStream, state: ReplicaState,
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
            if events >= 2:
                state.model.tpot.update(tpot.vector(), (last - first) / (events - 1))
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()
