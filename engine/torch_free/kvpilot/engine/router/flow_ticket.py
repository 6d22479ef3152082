"""A request's flow, band and latency objectives, read from its headers and model (pure).

- flow: the fairness id header (`x-gateway-inference-fairness-id`, what a Gateway API
  gateway or an API gateway in front sets per tenant); without it, the tenant of the
  request's API key (requests with the same bearer token share a flow, named by a short
  hash of it, never the key); without either, the flow `default`;
- band (priority): the objective named by `x-gateway-inference-objective`, else the one
  whose `models` list the requested model or adapter, else 0;
- objectives: `x-slo-ttft-ms` / `x-slo-tpot-ms`, else the objective's `ttftMs` / `tpotMs`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvpilot.engine.contracts.router_objectives import (
    FAIRNESS_ID_HEADER,
    OBJECTIVE_HEADER,
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
    Objective,
)

DEFAULT_FLOW = "default"
FLOW_ID_PATTERN = re.compile(r"^[\x21-\x7e]{1,128}$")  # visible ASCII: a metric label's worth
MAX_SLO_MS = 3_600_000.0


class BadFlowHeader(ValueError):
    """A flow-control header the router cannot use; `header` names it (the 400's param)."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(message)
        self.header = header


@dataclass(frozen=True)
class FlowTicket:
    """How flow control and placement treat one request."""

    flow: str = DEFAULT_FLOW
    priority: int = 0
    objective: str = ""
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None

    @property
    def key(self) -> tuple[str, int]:
        """Gives (flow, band): what flow control's queue and fair share count by."""
        return self.flow, self.priority


def _slo_seconds(headers: Mapping[str, str], header: str, fallback: float | None
                 ) -> float | None:
    raw = headers.get(header)
    if raw is None:
        return None if fallback is None else fallback / 1000.0
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_SLO_MS:
        raise BadFlowHeader(header, f"{header}={raw!r} is invalid: give milliseconds in "
                                    f"(0, {MAX_SLO_MS:.0f}]")
    return value / 1000.0


def flow_of(headers: Mapping[str, str]) -> str:
    """Gives the request's flow: its fairness id, else its API key's tenant, else default."""
    fairness = headers.get(FAIRNESS_ID_HEADER)
    if fairness is not None:
        if not FLOW_ID_PATTERN.match(fairness):
            raise BadFlowHeader(FAIRNESS_ID_HEADER, f"{FAIRNESS_ID_HEADER}={fairness[:40]!r} is "
                                "invalid: give 1-128 visible ASCII characters")
        return fairness
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token:
        return "key-" + hashlib.sha256(token.encode()).hexdigest()[:12]
    return DEFAULT_FLOW


def classify(headers: Mapping[str, str], model: object,
             objectives: tuple[Objective, ...]) -> FlowTicket:
    """Gives the request's ticket; BadFlowHeader naming the header when one is unusable.

    `headers` is case-insensitive (Starlette's) or lower-cased.
    """
    named = headers.get(OBJECTIVE_HEADER)
    objective: Objective | None = None
    if named is not None:
        objective = next((o for o in objectives if o.name == named), None)
        if objective is None:
            known = ", ".join(o.name for o in objectives) or "none (kvpilot route --objectives)"
            raise BadFlowHeader(OBJECTIVE_HEADER, f"{OBJECTIVE_HEADER}={named[:40]!r} names no "
                                f"objective of this router: choose one of {known}")
    elif isinstance(model, str):
        objective = next((o for o in objectives if model in o.models), None)
    return FlowTicket(
        flow=flow_of(headers),
        priority=objective.priority if objective else 0,
        objective=objective.name if objective else "",
        ttft_slo_s=_slo_seconds(headers, SLO_TTFT_HEADER, objective.ttft_ms if objective else None),
        tpot_slo_s=_slo_seconds(headers, SLO_TPOT_HEADER, objective.tpot_ms if objective else None))
