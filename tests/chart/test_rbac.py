"""The chart's ClusterRole grants exactly what the operator calls: no more, no less."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvpilot.operator.rbac import RULES, verbs_by_resource


def granted(objects: list[dict[str, Any]], kind: str = "ClusterRole",
            namespace: str | None = None) -> dict[tuple[str, str], set[str]]:
    """Gives {(group, resource): verbs} of the rendered ClusterRole (or a namespace's Role)."""
    role = next(o for o in objects if o["kind"] == kind
                and o["metadata"].get("namespace", namespace) == namespace)
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def expected(flags: set[str], per_namespace: bool | None = None,
             ) -> dict[tuple[str, str], set[str]]:
    """Gives the table's needs when the operator runs with `flags` (only the rules granted
    per namespace, or only the others, when `per_namespace` says so)."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in RULES:
        if per_namespace is not None and rule.per_namespace != per_namespace:
            continue
        if rule.optional_flag is None or rule.optional_flag in flags:
            out.setdefault((rule.group, rule.resource), set()).update(rule.verbs)
    return out


@pytest.mark.parametrize(("sets", "flags"), [
    ((), set()),
    (("replicaCount=2",), {"--peering"}),
    (("operator.leaderWorkerSet=true",), {"--leader-worker-set"}),
    (("replicaCount=3", "operator.leaderWorkerSet=true"), {"--peering", "--leader-worker-set"}),
], ids=["default", "peering", "lws", "both"])
def test_cluster_role_is_exactly_the_table(render: Callable[..., list[dict[str, Any]]],
                                           sets: tuple[str, ...], flags: set[str]):
    assert granted(render(sets=sets)) == expected(flags)


def test_watched_namespaces_get_the_pod_grant_as_roles(
        render: Callable[..., list[dict[str, Any]]]):
    objects = render(sets=("operator.watchNamespaces={team-a,team-b}",))
    assert granted(objects) == expected(set(), per_namespace=False)
    for namespace in ("team-a", "team-b"):
        assert granted(objects, "Role", namespace) == expected(set(), per_namespace=True)
        binding = next(o for o in objects if o["kind"] == "RoleBinding"
                       and o["metadata"]["namespace"] == namespace)
        assert binding["subjects"][0]["namespace"] == "kvpilot-system"


def test_rbac_create_false_renders_no_rbac(render: Callable[..., list[dict[str, Any]]]):
    kinds = {o["kind"] for o in render(sets=("rbac.create=false",))}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}


def test_table_covers_every_kopf_handler():
    """Each resource a kopf handler serves is listed with list+watch (+patch when kopf
    stores handler progress on it), read from kopf's registry after registering handlers."""
    import kopf

    from kvpilot.operator.handlers import register

    register()
    registry = kopf.get_default_registry()
    needs: dict[tuple[str, str], set[str]] = {}
    for handler in registry._changing.get_all_handlers():
        key = (handler.selector.group or "", handler.selector.any_name)
        needs.setdefault(key, set()).update({"list", "watch", "patch"})
    for handler in registry._watching.get_all_handlers():
        key = (handler.selector.group or "", handler.selector.any_name)
        needs.setdefault(key, set()).update({"list", "watch"})
    assert needs, "no kopf handlers registered"
    table = verbs_by_resource(include_optional=False)
    for key, verbs in needs.items():
        assert verbs <= table.get(key, set()), f"{key} needs {sorted(verbs)}"
