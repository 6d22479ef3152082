"""The `autoscaling` block of a pool: who scales it, and kvpilot's targets, bounds and windows.

Field names are the ones `kvpilot.operator.autoscale.spec.from_api` reads. An `autoscaling`
block that is present means the operator leaves `spec.replicas` to an autoscaler:
kvpilot's own (`mode: kvpilot`, the other fields), or an HPA / KEDA ScaledObject on the
pool's scale subresource (`mode: external`, no other field). Absent: static replicas.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from kvpilot.operator.api.base import ApiModel
from kvpilot.operator.api.names import MAX_REPLICAS
from kvpilot.operator.api.rules import CelRule, validations


class ScalingRules(ApiModel):
    """How fast replicas may change in one direction."""

    stabilization_window_seconds: int = Field(default=0, ge=0, le=3600)
    """The decision must have held this long before it applies."""
    max_replicas_per_period: int = Field(default=4, ge=1, le=MAX_REPLICAS)
    """At most this many replicas added or removed per period."""
    period_seconds: int = Field(default=60, ge=1, le=3600)
    """Length of the rate-limit period."""


def _scale_down_rules() -> ScalingRules:
    return ScalingRules(stabilization_window_seconds=300, max_replicas_per_period=1)


class AutoscalingTargets(ApiModel):
    """Per-replica levels the autoscaler steers towards."""

    kv_cache_utilization: float = Field(default=0.8, gt=0, le=1)
    """Fraction of KV-cache blocks in use (vllm:kv_cache_usage_perc)."""
    queue_depth_per_replica: float = Field(default=4.0, gt=0)
    """Waiting requests per replica (vllm:num_requests_waiting)."""
    waiting_prompt_tokens_per_replica: float | None = Field(default=None, gt=0)
    """Prompt tokens waiting per replica (unset: the autoscaler's role default, 16384)."""
    running_requests_per_replica: float | None = Field(default=None, gt=0)
    """Running requests per replica (unset: the autoscaler's role default, 96)."""
    ttft_seconds: float | None = Field(default=None, gt=0)
    """Optional p90 time-to-first-token SLO in seconds."""
    itl_seconds: float | None = Field(default=None, gt=0)
    """Optional p90 inter-token latency SLO in seconds."""


AutoscalingMode = Literal["kvpilot", "external"]
"""Who writes a pool's spec.replicas: kvpilot's autoscaler, or an external HPA / KEDA."""

AUTOSCALING_RULES = [
    CelRule("self.minReplicas <= self.maxReplicas",
            "minReplicas must be at most maxReplicas: lower minReplicas or raise maxReplicas"),
]


class AutoscalingSpec(ApiModel):
    """Scale a pool on KV-cache pressure and queue depth; present means enabled."""

    model_config = ConfigDict(json_schema_extra=validations(AUTOSCALING_RULES))

    mode: AutoscalingMode = "kvpilot"
    """kvpilot: this block's policy scales the pool; external: an HPA or KEDA ScaledObject on
    the pool's scale subresource does, and kvpilot never writes spec.replicas after creating
    the pool (the other fields are kvpilot's policy: leave them unset)."""
    min_replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    """Fewest replicas (0 allows scale to zero)."""
    max_replicas: int = Field(default=4, ge=1, le=MAX_REPLICAS)
    """Most replicas."""
    targets: AutoscalingTargets = Field(default_factory=AutoscalingTargets,
                                        json_schema_extra={"default": {}})
    """Levels to steer towards."""
    interval_seconds: int = Field(default=15, ge=1, le=600)
    """How often pod metrics are scraped and a decision is made."""
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    """No change while observed/target stays within 1 +- tolerance."""
    max_metrics_age_seconds: int | None = Field(default=None, ge=1)
    """Older samples count as missing (unset: 4 x intervalSeconds)."""
    scale_up: ScalingRules = Field(default_factory=ScalingRules, json_schema_extra={"default": {}})
    """Rules for adding replicas (default: immediately, 4 per minute)."""
    scale_down: ScalingRules = Field(
        default_factory=_scale_down_rules,
        json_schema_extra={"default": {"stabilizationWindowSeconds": 300, "maxReplicasPerPeriod": 1}})
    """Rules for removing replicas (default: after 300 s stable, 1 per minute)."""

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"autoscaling.minReplicas={self.min_replicas} > maxReplicas="
                             f"{self.max_replicas}: {AUTOSCALING_RULES[0].message}")
        if self.mode == "external":
            for name, value in self.to_json().items():
                default = _DEFAULTS.get(name)
                if name != "mode" and value != default:
                    raise ValueError(
                        f"autoscaling.{name}={value!r} with autoscaling.mode=external: kvpilot's "
                        "policy fields are not read when an HPA or KEDA scales the pool; set "
                        "the bounds and targets on that object and remove this field")
        return self


_DEFAULTS = AutoscalingSpec.model_construct().to_json()
"""Every field at its default (what the API server fills in), to tell which ones a user set."""
