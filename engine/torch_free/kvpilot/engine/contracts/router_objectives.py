"""Objectives the router schedules by, and the request headers that name flows and objectives.

Torch-free on purpose: the operator renders an InferenceModel's `spec.router.objectives`
into `kvpilot route --objectives JSON` with `objectives_json`, and the router reads it
back with `parse_objectives`. The header names are the Gateway API inference extension's
(flow control's fairness id, the InferenceObjective a request runs under) and the SLO
headers its predicted-latency scorer reads, so a gateway in front passes them unchanged.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# The flow (tenant) a request belongs to, for fair queuing between flows of one band.
FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
# The objective (by name) a request runs under: its priority band and default SLOs.
OBJECTIVE_HEADER = "x-gateway-inference-objective"
# Per-request latency objectives, in milliseconds (they override the objective's).
SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"
# What the router predicted for the replica it chose (predicted-latency policy), so a
# client or a benchmark can judge the prediction against what it saw.
PREDICTED_TTFT_HEADER = "x-kvpilot-predicted-ttft-ms"

NAME_PATTERN = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,126}[A-Za-z0-9])?$")
MAX_OBJECTIVES = 64


@dataclass(frozen=True)
class Objective:
    """A named priority band, the models or adapters that run under it, and its SLOs."""

    name: str
    priority: int = 0
    models: tuple[str, ...] = ()
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"name": self.name, "priority": self.priority}
        if self.models:
            out["models"] = list(self.models)
        if self.ttft_ms is not None:
            out["ttftMs"] = self.ttft_ms
        if self.tpot_ms is not None:
            out["tpotMs"] = self.tpot_ms
        return out


def objectives_json(objectives: tuple[Objective, ...]) -> str:
    """Gives the `--objectives` text of these objectives (compact JSON)."""
    return json.dumps([o.to_json() for o in objectives], separators=(",", ":"))


def _number(item: dict[str, object], key: str, where: str) -> float | None:
    value = item.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"objectives{where}.{key}={value!r} is invalid: give milliseconds > 0")
    return float(value)


def parse_objectives(text: str) -> tuple[Objective, ...]:
    """Gives the objectives of `--objectives` JSON: a list of {"name", "priority", "models",
    "ttftMs", "tpotMs"}; a ValueError naming the item and field otherwise."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"objectives is not JSON ({exc}): give a list such as "
                         '[{"name": "premium", "priority": 10}]') from None
    if not isinstance(items, list) or len(items) > MAX_OBJECTIVES:
        raise ValueError(f"objectives must be a JSON list of at most {MAX_OBJECTIVES} objects")
    out: list[Objective] = []
    claimed: dict[str, str] = {}
    for n, item in enumerate(items):
        where = f"[{n}]"
        if not isinstance(item, dict):
            raise ValueError(f"objectives{where} is {type(item).__name__}: give an object")
        unknown = set(item) - {"name", "priority", "models", "ttftMs", "tpotMs"}
        if unknown:
            raise ValueError(f"objectives{where} has unknown field(s) {sorted(unknown)}: use "
                             "name, priority, models, ttftMs, tpotMs")
        name, priority = item.get("name"), item.get("priority", 0)
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ValueError(f"objectives{where}.name={name!r} is invalid: 1-128 letters, "
                             "digits, '.', '_' or '-'")
        if any(o.name == name for o in out):
            raise ValueError(f"objectives{where}.name={name!r} is given twice: names are unique")
        if isinstance(priority, bool) or not isinstance(priority, int) or \
                not -1000 <= priority <= 1000:
            raise ValueError(f"objectives{where}.priority={priority!r} is invalid: give an "
                             "integer in -1000..1000 (higher is served first)")
        models = item.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise ValueError(f"objectives{where}.models={models!r} is invalid: give a list of "
                             "model or adapter names")
        for model in models:
            if model in claimed:
                raise ValueError(f"objectives{where}.models names {model!r}, already under "
                                 f"objective {claimed[model]!r}: a model has one objective")
            claimed[model] = name
        out.append(Objective(name, priority, tuple(models), _number(item, "ttftMs", where),
                             _number(item, "tpotMs", where)))
    return tuple(out)
