"""The policy's view of a pool's `autoscaling` block: plain dataclasses, role-aware signals.

The CRD model (`kvpilot.operator.api.autoscaling.AutoscalingSpec`) is the source of the
field names; this module turns it (or the camelCase dict kopf hands a handler)
into frozen dataclasses the pure policy and the simulator use without pydantic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvpilot.operator.api.autoscaling import AutoscalingSpec

# Signal names are the camelCase target fields of the CRD, so a decision's reason
# names the field the user set.
KV_CACHE = "kvCacheUtilization"
QUEUE_DEPTH = "queueDepthPerReplica"
WAITING_PROMPT_TOKENS = "waitingPromptTokensPerReplica"
RUNNING_REQUESTS = "runningRequestsPerReplica"
TTFT = "ttftSeconds"
ITL = "itlSeconds"
LATENCY_SIGNALS = (TTFT, ITL)

# Prefill pools fill a queue of prompts and hold little KV; decode pools hold KV
# for every running sequence and queue only once KV or sequence slots run out.
# Aggregated pools ("both") see all four pressures.
ROLE_SIGNALS: dict[str, tuple[str, ...]] = {
    "prefill": (QUEUE_DEPTH, WAITING_PROMPT_TOKENS, TTFT),
    "decode": (KV_CACHE, RUNNING_REQUESTS, QUEUE_DEPTH, ITL),
    "both": (KV_CACHE, QUEUE_DEPTH, WAITING_PROMPT_TOKENS, RUNNING_REQUESTS, TTFT, ITL),
}

# Defaults of targets the CRD does not (yet) carry; sized for a 1-GPU replica
# with max_num_seqs 256 and max_num_batched_tokens 8192.
DEFAULT_TARGETS: dict[str, float | None] = {
    KV_CACHE: 0.8,
    QUEUE_DEPTH: 4.0,
    WAITING_PROMPT_TOKENS: 16384.0,
    RUNNING_REQUESTS: 96.0,
    TTFT: None,
    ITL: None,
}


@dataclass(frozen=True)
class ScalingRules:
    """How fast replicas may change in one direction."""

    stabilization_window_seconds: float = 0.0
    max_replicas_per_period: int = 4
    period_seconds: float = 60.0


@dataclass(frozen=True)
class PolicySpec:
    """Everything the policy needs to decide for one pool."""

    role: str = "both"
    min_replicas: int = 1
    max_replicas: int = 4
    targets: Mapping[str, float] = field(default_factory=dict)
    """Active signals only: name -> per-replica target (latency ones in seconds)."""
    tolerance: float = 0.1
    """No change while observed/target stays within 1 ± tolerance."""
    interval_seconds: float = 15.0
    metrics_window_seconds: float = 60.0
    """Samples this recent (at the current size) are averaged before voting."""
    max_metrics_age_seconds: float = 60.0
    """Older samples count as missing (they never scale down)."""
    scale_up: ScalingRules = field(default_factory=ScalingRules)
    scale_down: ScalingRules = field(
        default_factory=lambda: ScalingRules(300.0, 1, 60.0))
    gpus_per_replica: int = 1
    pod_startup_seconds: float = 120.0
    """A scale-up waits up to this long for the pods of the previous one to report
    before adding more (their capacity is on its way; adding more overshoots); longer when
    the pool's engines report a longer start-up (`kvpilot_engine_startup_seconds`: loading,
    CUDA graphs, the warm-up)."""
    running_knee: float = 64.0
    """Running requests per replica at which the decode step time is twice its floor
    (c0/c1 of step = c0 + c1·batch); 64 fits an 8B model on one H100."""

    def __post_init__(self) -> None:
        if self.role not in ROLE_SIGNALS:
            raise ValueError(f"role={self.role!r} is invalid: choose one of "
                             f"{', '.join(ROLE_SIGNALS)}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"autoscaling.minReplicas={self.min_replicas} and maxReplicas="
                             f"{self.max_replicas} are invalid: need 0 <= minReplicas <= "
                             "maxReplicas")
        for name, target in self.targets.items():
            if name not in DEFAULT_TARGETS or target <= 0:
                raise ValueError(f"autoscaling.targets.{name}={target!r} is invalid: use a "
                                 f"positive target of one of {', '.join(DEFAULT_TARGETS)}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"autoscaling.tolerance={self.tolerance!r} is invalid: use 0..1")

    def with_bounds(self, min_replicas: int, max_replicas: int) -> PolicySpec:
        """Gives a copy with other replica bounds."""
        return replace(self, min_replicas=min_replicas, max_replicas=max_replicas)


def role_targets(role: str, given: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Gives the active signals of a role: the role's defaults overlaid with `given` targets."""
    given = {k: v for k, v in (given or {}).items() if v is not None}
    out: dict[str, float] = {}
    for name in ROLE_SIGNALS[role]:
        value = given.get(name, DEFAULT_TARGETS[name])
        if value is not None:
            out[name] = float(value)
    return out


def _rules(raw: Mapping[str, Any] | None, default: ScalingRules) -> ScalingRules:
    raw = {k: v for k, v in (raw or {}).items() if v is not None}
    return ScalingRules(
        stabilization_window_seconds=float(raw.get("stabilizationWindowSeconds",
                                                   default.stabilization_window_seconds)),
        max_replicas_per_period=int(raw.get("maxReplicasPerPeriod",
                                            default.max_replicas_per_period)),
        period_seconds=float(raw.get("periodSeconds", default.period_seconds)),
    )


def from_api(autoscaling: AutoscalingSpec | Mapping[str, Any] | None, role: str,
             gpus_per_replica: int = 1) -> PolicySpec:
    """Gives the PolicySpec of a CRD `autoscaling` block (pydantic model or camelCase dict).

    Unset (or null) fields take the CRD's defaults; `maxMetricsAgeSeconds` and
    `metricsWindowSeconds` default to four intervals.
    """
    given = autoscaling.to_json() if isinstance(autoscaling, AutoscalingSpec) \
        else dict(autoscaling or {})
    raw: Mapping[str, Any] = {k: v for k, v in given.items() if v is not None}
    base = PolicySpec()
    interval = float(raw.get("intervalSeconds", base.interval_seconds))
    return PolicySpec(
        role=role,
        min_replicas=int(raw.get("minReplicas", base.min_replicas)),
        max_replicas=int(raw.get("maxReplicas", base.max_replicas)),
        targets=role_targets(role, raw.get("targets")),
        tolerance=float(raw.get("tolerance", base.tolerance)),
        interval_seconds=interval,
        metrics_window_seconds=float(raw.get("metricsWindowSeconds", 4 * interval)),
        max_metrics_age_seconds=float(raw.get("maxMetricsAgeSeconds", 4 * interval)),
        scale_up=_rules(raw.get("scaleUp"), base.scale_up),
        scale_down=_rules(raw.get("scaleDown"), base.scale_down),
        gpus_per_replica=gpus_per_replica,
    )
