"""Names the operator derives from an object's name, and the longest name each kind may have.

Every child is named `<owner>-<suffix>`. Kubernetes bounds those names (Services and label
values: 63 characters, DNS-1035; StatefulSets: 52, because the controller labels their
pods `controller-revision-hash=<name>-<10-character hash>`), so the longest suffix the
operator appends decides how long an InferenceModel's or a pool's own name may be.
Admission refuses a longer name, a dot or a leading digit instead of the operator
shortening names into something nobody can predict.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from kvpilot.operator.api.rules import CelRule

MAX_REPLICAS = 1000
"""Most replicas of one pool: bounds what one object can make the operator render."""
DNS_LABEL_MAX = 63
STATEFULSET_NAME_MAX = 52
DNS_1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
POOL_SUFFIXES = ("prefill", "decode")


def child_name(*parts: str) -> str:
    """Gives a child's name: the parts joined by '-' (admission keeps it a DNS-1035 label)."""
    return "-".join(parts).lower()


def pool_name(model: str, role: str) -> str:
    """Gives the name of an InferenceModel's prefill or decode pool."""
    return child_name(model, "prefill" if role == "prefill" else "decode")


def group_name(pool: str, replica: int) -> str:
    """Gives the StatefulSet name of one multi-node replica."""
    return child_name(pool, f"g{replica}")


def lws_group_name(pool: str, replica: int) -> str:
    """Gives the StatefulSet the LeaderWorkerSet controller makes for one group's workers."""
    return child_name(pool, str(replica))


def rendezvous_service_name(pool: str) -> str:
    """Gives the name of a pool's headless Service (the StatefulSets' governing Service)."""
    return child_name(pool, "workers")


def router_name(model: str) -> str:
    """Gives the name of an InferenceModel's router Deployment, Service and ServiceAccount."""
    return child_name(model, "router")


def engine_config_name(model: str) -> str:
    """Gives the name of an InferenceModel's engine ConfigMap."""
    return child_name(model, "engine")


def fleet_secret_name(model: str) -> str:
    """Gives the name of the Secret holding a model's fleet secret (KV-path authentication)."""
    return child_name(model, "fleet")


WEIGHTS_KEY_CHARS = 10
"""Hex digits of a weight download's key (repository, revision, filters) in its cache's name
(`weights/request.py: FetchRequest.key`; tests/admission/test_names.py renders one)."""
JOB_DIGEST_CHARS = 6
"""Hex digits of a weights Job's pod-template digest in its name."""


def weights_claim_name(model: str, key: str) -> str:
    """Gives the name of the claim caching one download of a model's weights (its Job's
    `kvpilot.dev/weights` label too)."""
    return child_name(model, "weights", key)


def weights_job_name(claim: str, digest: str) -> str:
    """Gives the name of the Job that fills `claim` with the pod template of `digest`."""
    return child_name(claim, digest)


def _weights_job(model: str) -> str:
    return weights_job_name(weights_claim_name(model, "k" * WEIGHTS_KEY_CHARS),
                            "d" * JOB_DIGEST_CHARS)


Derived = tuple[Callable[[str], str], int]
"""A name derived from the owner's name, and the most characters its kind allows."""

POOL_DERIVED: list[Derived] = [
    (lambda p: p, DNS_LABEL_MAX),  # Deployment, Service, PDB, NetworkPolicy; label value
    (lambda p: group_name(p, MAX_REPLICAS - 1), STATEFULSET_NAME_MAX),
    (lambda p: lws_group_name(p, MAX_REPLICAS - 1), STATEFULSET_NAME_MAX),
    (rendezvous_service_name, DNS_LABEL_MAX),
    (fleet_secret_name, DNS_LABEL_MAX),  # a pool without an InferenceModel owns its own
]
MODEL_DERIVED: list[Derived] = [
    *((lambda m, f=f, s=s: f(child_name(m, s)), limit)
      for f, limit in POOL_DERIVED for s in POOL_SUFFIXES),
    (router_name, DNS_LABEL_MAX), (engine_config_name, DNS_LABEL_MAX),
    (fleet_secret_name, DNS_LABEL_MAX),
    # The weight cache's claim name is a label value; a Job's name labels its pods.
    (lambda m: weights_claim_name(m, "k" * WEIGHTS_KEY_CHARS), DNS_LABEL_MAX),
    (_weights_job, DNS_LABEL_MAX),
]


def longest_name(derived: list[Derived]) -> int:
    """Gives the longest owner name for which every derived name fits its kind's limit."""
    return min(limit - (len(name("x")) - 1) for name, limit in derived)


MAX_NAME = {"InferenceModel": longest_name(MODEL_DERIVED),
            "PrefillPool": longest_name(POOL_DERIVED), "DecodePool": longest_name(POOL_DERIVED)}
"""Longest metadata.name per kind."""


def name_rules(kind: str) -> list[CelRule]:
    """Gives the root-level CEL rules on metadata.name of one kind."""
    limit = MAX_NAME[kind]
    return [
        CelRule(f"self.metadata.name.matches('{DNS_1035}')",
                "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', "
                "starting with a letter, no dots): it names Services and labels; rename the "
                "object", ".metadata.name"),
        CelRule(f"size(self.metadata.name) <= {limit}",
                f"metadata.name may have at most {limit} characters: the operator derives "
                "longer names from it (pools, StatefulSets of up to "
                f"{MAX_REPLICAS} replicas, Services, weights Jobs); shorten it",
                ".metadata.name"),
    ]


def check_name(kind: str, name: str) -> None:
    """Raises ValueError with the rule's message unless `name` fits what `kind` derives."""
    rules = name_rules(kind)
    if not re.search(DNS_1035, name):
        raise ValueError(f"metadata.name={name!r}: {rules[0].message}")
    if len(name) > MAX_NAME[kind]:
        raise ValueError(f"metadata.name={name!r} ({len(name)} characters): {rules[1].message}")
