"""Every (API group, resource, verbs) the operator calls, kept next to the code that calls it.

RBAC follows the namespaces the operator watches (`grants`): watching all of them, one
ClusterRole holds every rule; watching named ones, each gets a Role with the namespaced
rules, and only cluster-scoped rules (`scope="cluster"`) stay in a ClusterRole. There are
none of those in namespaced mode: kopf's resource and namespace scanning is off
(handlers/lifecycle.py), so it lists neither CRDs nor namespaces, and the peering of
namespaced operators is a KopfPeering per namespace. The Helm chart renders the same
(tested per mode); when a handler starts calling a new verb or resource, add it here in the
same change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

APPLY = ("create", "patch")  # Kube.apply: server-side apply, a PATCH that creates when absent
PRUNE = ("list", "delete")  # handlers.children.sync_children lists, then deletes the stale
WATCH = ("list", "watch")  # kopf watch streams
Grants = dict[tuple[str, str], set[str]]
"""{(API group, resource): verbs}."""


@dataclass(frozen=True)
class Rule:
    """One RBAC rule: the verbs the operator uses on a resource of an API group."""

    group: str
    resource: str
    verbs: tuple[str, ...]
    why: str
    optional_flag: str | None = None
    """Operator flag that turns this rule's calls on; None: always used."""
    scope: Literal["namespaced", "cluster"] = "namespaced"
    """cluster: a cluster-scoped resource, granted by a ClusterRole in every mode."""
    only: Literal["clusterwide", "namespaced"] | None = None
    """Used only when the operator watches all namespaces, or only named ones; None: both."""


def _verbs(*groups: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted({verb for group in groups for verb in group}))


RULES: tuple[Rule, ...] = (
    Rule("kvpilot.dev", "inferencemodels", _verbs(WATCH, ("get", "patch")),
         "kopf watches them and stores its state in annotations; pools read their model"),
    Rule("kvpilot.dev", "inferencemodels/status", ("patch",), "conditions and replica counts"),
    Rule("kvpilot.dev", "prefillpools", _verbs(WATCH, APPLY, PRUNE),
         "owned by InferenceModels; watched for their own reconciliation"),
    Rule("kvpilot.dev", "prefillpools/status", ("patch",), "conditions and scale fields"),
    Rule("kvpilot.dev", "decodepools", _verbs(WATCH, APPLY, PRUNE),
         "owned by InferenceModels; watched for their own reconciliation"),
    Rule("kvpilot.dev", "decodepools/status", ("patch",), "conditions and scale fields"),
    Rule("apps", "deployments", _verbs(WATCH, APPLY, PRUNE),
         "single-node pool replicas and the router; watched to roll ready counts up"),
    Rule("apps", "statefulsets", _verbs(WATCH, APPLY, PRUNE),
         "multi-node leader/worker groups; watched to roll ready counts up"),
    Rule("", "services", _verbs(APPLY, PRUNE), "pool, rendezvous and router Services"),
    Rule("", "configmaps", _verbs(APPLY, PRUNE), "the engine ConfigMap of an InferenceModel"),
    Rule("", "serviceaccounts", _verbs(APPLY, PRUNE), "the router's identity"),
    Rule("rbac.authorization.k8s.io", "roles", _verbs(APPLY, PRUNE),
         "the router's EndpointSlice reader Role"),
    Rule("rbac.authorization.k8s.io", "rolebindings", _verbs(APPLY, PRUNE),
         "binds the router's Role to its ServiceAccount"),
    Rule("discovery.k8s.io", "endpointslices", ("get", "list", "watch"),
         "held so the operator may grant them to the router (RBAC escalation check)"),
    Rule("policy", "poddisruptionbudgets", _verbs(APPLY, PRUNE), "one per pool"),
    Rule("", "events", ("create",), "decision events (kopf.info / kopf.warn)"),
    Rule("", "pods", _verbs(WATCH, ("patch",)),
         "status reasons read from pool and weights Job pods; the autoscaler scrapes ready "
         "pods and sets pod-deletion-cost before scale-down"),
    Rule("", "pods/log", ("get",),
         "the last progress line of a weights download (status.weights.progress)"),
    Rule("batch", "jobs", _verbs(WATCH, APPLY, PRUNE),
         "the Job that fills a model's weight cache; watched for status.weights"),
    Rule("", "persistentvolumeclaims", _verbs(APPLY, PRUNE), "a model's weight cache"),
    Rule("leaderworkerset.x-k8s.io", "leaderworkersets", _verbs(APPLY, PRUNE),
         "multi-node groups as LeaderWorkerSets", optional_flag="--leader-worker-set"),
    Rule("inference.networking.k8s.io", "inferencepools", _verbs(APPLY, PRUNE),
         "a model's engines behind a Gateway API gateway", optional_flag="--inference-pool"),
    Rule("kopf.dev", "kopfpeerings", _verbs(WATCH, ("get", "patch")),
         "peering between operator replicas watching named namespaces",
         optional_flag="--peering", only="namespaced"),
    Rule("kopf.dev", "clusterkopfpeerings", _verbs(WATCH, ("get", "patch")),
         "peering between operator replicas watching all namespaces",
         optional_flag="--peering", scope="cluster", only="clusterwide"),
)


def grants(namespaces: Sequence[str], flags: set[str]) -> dict[str | None, Grants]:
    """Gives what the operator needs when it watches `namespaces` (none: all) with `flags`:
    {None: the ClusterRole's grants, namespace: that namespace's Role's grants}; a role
    with nothing to grant is left out."""
    mode = "namespaced" if namespaces else "clusterwide"
    out: dict[str | None, Grants] = {}
    for rule in RULES:
        if (rule.optional_flag and rule.optional_flag not in flags) or \
                (rule.only and rule.only != mode):
            continue
        holders = [None] if rule.scope == "cluster" or not namespaces else list(namespaces)
        for holder in holders:
            out.setdefault(holder, {}).setdefault((rule.group, rule.resource), set()) \
                .update(rule.verbs)
    return out


def verbs_by_resource(include_optional: bool = True) -> dict[tuple[str, str], set[str]]:
    """Gives {(group, resource): verbs} for the rules, optionally without flag-gated ones."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in RULES:
        if rule.optional_flag and not include_optional:
            continue
        out.setdefault((rule.group, rule.resource), set()).update(rule.verbs)
    return out
