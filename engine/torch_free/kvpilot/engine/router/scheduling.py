"""Flow control and predicted-latency placement wired to one router's fleet and metrics.

`Router.handle` asks `begin` for a request's trip (its ticket, its admission through flow
control, its latency tracking) before it picks a replica; `Router.pick` asks `place` for
the predicted-latency choice. Everything decidable lives in the pure modules
(`flow_queue`, `saturation`, `flow_ticket`, `latency_model`, `latency_placement`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse, Response

from kvpilot.engine.contracts.openai_errors import error_object
from kvpilot.engine.contracts.router_args import RouterArgs
from kvpilot.engine.contracts.router_objectives import Objective, parse_objectives
from kvpilot.engine.router.fleet import Fleet, Instance
from kvpilot.engine.router.flow_control import Admission, ClientSide, FlowControl
from kvpilot.engine.router.flow_metrics import FlowMetrics
from kvpilot.engine.router.flow_queue import QueueLimits
from kvpilot.engine.router.flow_ticket import BadFlowHeader, FlowTicket, classify
from kvpilot.engine.router.latency_placement import Choice, choose_predicted
from kvpilot.engine.router.latency_tracker import LatencyModels, RequestLatency
from kvpilot.engine.router.metrics import RouterMetrics
from kvpilot.engine.router.saturation import LoadView, SaturationLimits, headroom

DEFAULT_OUTPUT_TOKENS = 16.0  # a request without max_tokens, for the TPOT model's context


class Scheduling:
    """One router's flow control (when on) and latency models."""

    def __init__(self, args: RouterArgs, fleet: Fleet, metrics: RouterMetrics,
                 serving_roles: Callable[[], tuple[str, ...]]) -> None:
        self.args, self.fleet, self.serving_roles = args, fleet, serving_roles
        self.objectives: tuple[Objective, ...] = (
            parse_objectives(args.objectives) if args.objectives else ())
        self.latency = LatencyModels(args.latency_min_samples, metrics.registry)
        self.flow: FlowControl | None = None
        if args.flow_control:
            self.flow = FlowControl(
                QueueLimits(args.max_queued_per_flow, args.max_queued_requests,
                            args.queue_timeout),
                SaturationLimits(args.saturation_queue_depth, args.saturation_kv_usage),
                self.loads, FlowMetrics(metrics.registry), unmeetable=args.slo_unmeetable,
                reserved_slots_fraction=args.reserved_slots_fraction)

    @property
    def predicted(self) -> bool:
        return self.args.policy == "predicted-latency"

    def loads(self) -> list[LoadView]:
        """Gives the ready serving replicas' loads (the decode side when disaggregated)."""
        return [self.load_of(i) for i in self.fleet.available(self.serving_roles())]

    @staticmethod
    def load_of(instance: Instance) -> LoadView:
        return LoadView(instance.url, instance.waiting, instance.in_flight,
                        instance.in_flight_at_scrape, instance.kv_usage, instance.running,
                        instance.max_num_seqs)

    def with_room(self, roles: tuple[str, ...], candidates: list[Instance]) -> list[Instance]:
        """Gives the candidates with room (`saturation.headroom`) when flow control gates
        these roles and any has room: a request flow control let go takes a free slot, not
        a place in a full engine's queue; otherwise all of them."""
        if self.flow is None or roles != self.serving_roles():
            return candidates
        free = [i for i in candidates if headroom(self.load_of(i), self.flow.saturation) > 0]
        return free or candidates

    def load_changed(self) -> None:
        """Lets queued requests go if the pool has room now."""
        if self.flow is not None:
            self.flow.drain()

    def prompt_tokens(self, num_blocks: int) -> float:
        """Gives the prompt's tokens as the router estimates them: its full blocks plus half
        a block for the tail it does not hash."""
        return (num_blocks + 0.5) * self.args.block_size

    async def begin(self, body: dict[str, Any], hashes: list[int], client: ClientSide | None,
                    tiers: Callable[[Instance], tuple[int, int]]
                    ) -> RequestLatency | Response:
        """Gives the request's trip once flow control lets it go, or the response that ends
        it here (400 for a bad flow header, 429 shed, 499 client gone)."""
        try:
            ticket = classify(client.headers if client else {}, body.get("model"),
                              self.objectives)
        except BadFlowHeader as exc:
            return JSONResponse(error_object(400, str(exc), exc.header),
                                400)
        prompt = self.prompt_tokens(len(hashes))
        output = body.get("max_tokens") or body.get("max_completion_tokens")
        output_tokens = float(output) if isinstance(output, int) and output > 0 \
            else DEFAULT_OUTPUT_TOKENS
        admission = Admission()
        if self.flow is not None:
            def meetable() -> bool:
                return self._meetable(ticket, prompt, output_tokens, hashes, tiers)
            gated = await self.flow.gate(ticket, client.disconnected if client else None,
                                         meetable)
            if isinstance(gated, Response):
                return gated
            admission = gated
        return RequestLatency(self.latency, ticket, prompt, output_tokens,
                              body.get("stream") is True, admission)

    def _meetable(self, ticket: FlowTicket, prompt: float, output: float, hashes: list[int],
                  tiers: Callable[[Instance], tuple[int, int]]) -> bool:
        if not self.predicted or (ticket.ttft_slo_s is None and ticket.tpot_slo_s is None):
            return True
        candidates = self.fleet.available(self.serving_roles())
        if not candidates or not self.latency.warm(i.url for i in candidates):
            return True  # nothing to predict with: the configured policy's guess stands
        choice = self.choose(ticket, prompt, output, [(i.url, tiers(i)) for i in candidates])
        return choice.meets

    def new_tokens(self, prompt: float, tiers: tuple[int, int]) -> float:
        """Gives the prompt tokens a replica must compute: less its probable prefix hit (a
        host-tier block counted at the prefix-aware policy's host-hit weight)."""
        gpu, host = tiers
        hit = (gpu + 0.5 * host) * self.args.block_size
        return max(prompt - hit, 0.0)

    def choose(self, ticket: FlowTicket, prompt: float, output: float,
               candidates: Sequence[tuple[str, tuple[int, int]]], counter: int = 0) -> Choice:
        """Gives the predicted-latency choice among (url, (gpu, host) hit blocks) candidates."""
        context = prompt + output / 2
        predictions = [self.latency.predict(url, self.new_tokens(prompt, t), context)
                       for url, t in candidates]
        return choose_predicted(predictions, ticket.ttft_slo_s, ticket.tpot_slo_s, counter)

    def place(self, trip: RequestLatency | None, candidates: Mapping[str, tuple[int, int]],
              counter: int) -> str | None:
        """Gives the predicted-latency choice's URL (noting the prediction on the trip), or
        None when the policy is another or a candidate's model is still cold."""
        if trip is None or not self.predicted or not self.latency.warm(candidates):
            return None
        choice = self.choose(trip.ticket, trip.prompt_tokens, trip.output_tokens,
                             list(candidates.items()), counter)
        trip.prediction = choice.prediction
        return choice.prediction.url

    def started(self, trip: RequestLatency | None, instance: Instance,
                tiers: tuple[int, int]) -> None:
        """Notes that `instance` took the trip's request."""
        if trip is not None:
            prediction = trip.prediction if trip.prediction and \
                trip.prediction.url == instance.url else None
            trip.started(instance.url, self.new_tokens(trip.prompt_tokens, tiers), prediction)

    def forget_gone(self) -> None:
        """Drops the models of replicas that left the fleet."""
        self.latency.keep(self.fleet.instances)
