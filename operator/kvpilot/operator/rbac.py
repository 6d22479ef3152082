"""Every (API group, resource, verbs) the operator calls, kept next to the code that calls it.

The Helm chart's ClusterRole is tested against `RULES`; when a handler starts
calling a new verb or resource, add it here in the same change.
"""

from __future__ import annotations

from dataclasses import dataclass

APPLY = ("create", "get", "patch")  # Kube.apply: POST, then GET + PATCH on a name conflict
PRUNE = ("list", "delete")  # handlers.children.prune
WATCH = ("list", "watch")  # kopf watch streams


@dataclass(frozen=True)
class Rule:
    """One RBAC rule: the verbs the operator uses on a resource of an API group."""

    group: str
    resource: str
    verbs: tuple[str, ...]
    why: str
    optional_flag: str | None = None
    """Operator flag that turns this rule's calls on; None: always used."""
    per_namespace: bool = False
    """Granted by a Role in each watched namespace when the operator watches named
    namespaces (the chart's ClusterRole holds it only when it watches all of them)."""


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
    Rule("networking.k8s.io", "networkpolicies", _verbs(APPLY, PRUNE),
         "one per pool and one per router"),
    Rule("", "secrets", ("create",),
         "the fleet Secret, created once; never read, so no get/list/watch on Secrets"),
    Rule("", "events", ("create",), "decision events (kopf.info / kopf.warn)"),
    Rule("", "pods", ("list", "patch"),
         "the autoscaler scrapes ready pool pods and sets pod-deletion-cost before scale-down "
         "(the only pod field it writes; RBAC cannot narrow a patch to one annotation, so the "
         "grant is narrowed to the watched namespaces where there are some)",
         per_namespace=True),
    Rule("apiextensions.k8s.io", "customresourcedefinitions", WATCH,
         "kopf discovers the served resources"),
    Rule("", "namespaces", WATCH, "kopf follows namespaces when watching patterns"),
    Rule("leaderworkerset.x-k8s.io", "leaderworkersets", _verbs(APPLY, PRUNE),
         "multi-node groups as LeaderWorkerSets", optional_flag="--leader-worker-set"),
    Rule("kopf.dev", "kopfpeerings", _verbs(WATCH, ("get", "patch")),
         "peering between operator replicas", optional_flag="--peering"),
    Rule("kopf.dev", "clusterkopfpeerings", _verbs(WATCH, ("get", "patch")),
         "peering between operator replicas watching all namespaces",
         optional_flag="--peering"),
)


def verbs_by_resource(include_optional: bool = True) -> dict[tuple[str, str], set[str]]:
    """Gives {(group, resource): verbs} for the rules, optionally without flag-gated ones."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in RULES:
        if rule.optional_flag and not include_optional:
            continue
        out.setdefault((rule.group, rule.resource), set()).update(rule.verbs)
    return out
