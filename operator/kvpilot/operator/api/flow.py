"""The router's flow control and objectives in an InferenceModel (`spec.router.flowControl`,
`spec.router.objectives`), rendered into `kvpilot route` flags (`render/router.py`).

An objective names a priority band (higher first) and, optionally, latency objectives;
requests run under the objective their `x-gateway-inference-objective` header names, else
the one whose `models` list the model or adapter they ask for. Every rule lives twice: CEL
(`FLOW_RULES`, `OBJECTIVE_RULES`, refused at `kubectl apply`) and `check_objectives` (the
operator and `kvpilot up`), with the same messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from kvpilot.operator.api.adapters import ADAPTER_NAME, AdapterSpec
from kvpilot.operator.api.base import ApiModel
from kvpilot.operator.api.rules import CelRule, JsonDict, validations

MAX_OBJECTIVES = 16
MAX_OBJECTIVE_MODELS = 16
OBJECTIVES_LIST: JsonDict = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}

PER_FLOW_WITHIN_TOTAL = ("maxQueuedPerFlow must be at most maxQueuedRequests: raise "
                         "maxQueuedRequests or lower maxQueuedPerFlow")
SERVED_MODELS = ("objectives' models must name spec.model.name or one of spec.adapters: fix the "
                 "name or add the adapter")
ONE_OBJECTIVE = "a model or adapter runs under one objective: list it in one objective's models"
FLOW_RULES = [CelRule("self.maxQueuedPerFlow <= self.maxQueuedRequests", PER_FLOW_WITHIN_TOTAL,
                      ".maxQueuedPerFlow")]
OBJECTIVE_RULES = [
    CelRule("!has(self.router.objectives) || self.router.objectives.all(o, !has(o.models) || "
            "o.models.all(m, m == self.model.name || (has(self.adapters) && "
            "self.adapters.exists(a, a.name == m))))", SERVED_MODELS, ".router.objectives"),
    CelRule("!has(self.router.objectives) || self.router.objectives.all(o, !has(o.models) || "
            "o.models.all(m, self.router.objectives.filter(p, has(p.models) && m in p.models)"
            ".size() == 1))", ONE_OBJECTIVE, ".router.objectives"),
]


class FlowControlSpec(ApiModel):
    """Queue requests per flow and priority while every engine is saturated. The engines then
    run --scheduling-policy priority (unless spec.engine.extraArgs sets it): the router sends
    each request's band, quiet flows first, as its engine priority."""

    model_config = ConfigDict(json_schema_extra=validations(FLOW_RULES))

    saturation_queue_depth: int = Field(default=2, ge=1, le=1024)
    """Requests waiting in an engine's queue that saturate it (engines without
    kvpilot_max_num_seqs; the others saturate when their slots are full)."""
    saturation_kv_cache_usage: float = Field(default=0.95, gt=0, le=1)
    """KV cache usage (0..1) that saturates an engine."""
    reserved_slots_fraction: float = Field(default=0.125, ge=0, lt=1)
    """Fraction of the engines' slots whose last free ones go only to flows under their
    fair share."""
    max_queued_per_flow: int = Field(default=64, ge=1, le=100_000)
    """Requests one flow may queue per band."""
    max_queued_requests: int = Field(default=1024, ge=1, le=1_000_000)
    """Requests queued in all."""
    queue_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    """Seconds queued before a 429."""
    slo_unmeetable: Literal["queue", "shed"] = "queue"
    """A request whose objective no engine is predicted to meet: queue or shed."""

    @model_validator(mode="after")
    def _per_flow_within_total(self) -> FlowControlSpec:
        if self.max_queued_per_flow > self.max_queued_requests:
            raise ValueError(f"maxQueuedPerFlow={self.max_queued_per_flow} > maxQueuedRequests="
                             f"{self.max_queued_requests}: {PER_FLOW_WITHIN_TOTAL}")
        return self


class ObjectiveSpec(ApiModel):
    """A priority band and its latency objectives."""

    name: str = Field(max_length=63, json_schema_extra={"pattern": ADAPTER_NAME})
    """As sent in x-gateway-inference-objective."""
    priority: int = Field(default=0, ge=-1000, le=1000)
    """Higher is served first, shed last."""
    models: list[Annotated[str, Field(max_length=253)]] | None = Field(
        default=None, max_length=MAX_OBJECTIVE_MODELS)
    """Models or adapters (as clients send `model`) under it by default."""
    ttft_ms: int | None = Field(default=None, ge=1, le=3_600_000)
    """TTFT objective in ms."""
    tpot_ms: int | None = Field(default=None, ge=1, le=3_600_000)
    """TPOT objective in ms."""


def check_objectives(objectives: Sequence[ObjectiveSpec], model_name: str,
                     adapters: Sequence[AdapterSpec]) -> None:
    """Raises ValueError naming `spec.router.objectives[i]` and the fix when the objectives
    break a rule of `OBJECTIVE_RULES` (or repeat a name, which the API server refuses)."""
    served = {model_name, *(a.name for a in adapters)}
    names: set[str] = set()
    claimed: dict[str, str] = {}
    for i, objective in enumerate(objectives):
        if objective.name in names:
            raise ValueError(f"spec.router.objectives[{i}].name={objective.name!r} repeats: "
                             "objective names are unique")
        names.add(objective.name)
        for model in objective.models or []:
            if model not in served:
                raise ValueError(f"spec.router.objectives[{i}].models names {model!r}: "
                                 f"{SERVED_MODELS}")
            if claimed.get(model, objective.name) != objective.name:
                raise ValueError(f"spec.router.objectives[{i}].models names {model!r}, also "
                                 f"under objective {claimed[model]!r}: {ONE_OBJECTIVE}")
            claimed[model] = objective.name
