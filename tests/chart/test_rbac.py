"""The chart's RBAC grants exactly what the operator calls, per mode: no more, no less.

Watching every namespace: one ClusterRole. Watching named namespaces: a Role and RoleBinding
in each and no ClusterRole (kvpilot.operator.rbac.grants says the same).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvpilot.operator.rbac import grants, verbs_by_resource

ROLE_KINDS = {"ClusterRole", "Role"}


def granted(objects: list[dict[str, Any]]) -> dict[str | None, dict[tuple[str, str], set[str]]]:
    """Gives {None: the ClusterRole's grants, namespace: its Role's grants} as rendered."""
    out: dict[str | None, dict[tuple[str, str], set[str]]] = {}
    for role in (o for o in objects if o["kind"] in ROLE_KINDS):
        holder = role["metadata"]["namespace"] if role["kind"] == "Role" else None
        assert holder not in out, f"two roles for {holder}"
        table = out.setdefault(holder, {})
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    table.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def bindings(objects: list[dict[str, Any]]) -> dict[str | None, str]:
    """Gives {None or namespace: the role a binding there grants to the operator's account}."""
    return {o["metadata"].get("namespace") if o["kind"] == "RoleBinding" else None:
            f"{o['roleRef']['kind']}/{o['roleRef']['name']}"
            for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding")
            and o["subjects"] == [{"kind": "ServiceAccount", "name": "kv-kvpilot",
                                   "namespace": "kvpilot-system"}]}


MODES = [
    ((), [], set()),
    (("replicaCount=2",), [], {"--peering"}),
    (("operator.leaderWorkerSet=true",), [], {"--leader-worker-set"}),
    (("replicaCount=3", "operator.leaderWorkerSet=true"), [], {"--peering", "--leader-worker-set"}),
    (("operator.watchNamespaces={team-a}",), ["team-a"], set()),
    (("operator.watchNamespaces={team-a,team-b}", "replicaCount=2"), ["team-a", "team-b"],
     {"--peering"}),
    (("operator.watchNamespaces={team-a}", "operator.leaderWorkerSet=true"), ["team-a"],
     {"--leader-worker-set"}),
    (("operator.inferencePool=true",), [], {"--inference-pool"}),
    (("operator.watchNamespaces={team-a}", "operator.inferencePool=true"), ["team-a"],
     {"--inference-pool"}),
]
IDS = ["all", "all-peering", "all-lws", "all-both", "one-ns", "two-ns-peering", "one-ns-lws",
       "all-gateway", "one-ns-gateway"]


@pytest.mark.parametrize(("sets", "namespaces", "flags"), MODES, ids=IDS)
def test_rendered_rbac_is_exactly_the_table_for_the_mode(
        render: Callable[..., list[dict[str, Any]]], sets: tuple[str, ...],
        namespaces: list[str], flags: set[str]):
    objects = render(sets=sets)
    assert granted(objects) == grants(namespaces, flags)
    holders = namespaces or [None]
    assert bindings(objects) == {h: f"{'Role' if h else 'ClusterRole'}/kv-kvpilot"
                                 for h in holders}


@pytest.mark.parametrize(("sets", "namespaces", "flags"), MODES, ids=IDS)
def test_rendered_rbac_validates_for_kubernetes(render: Callable[..., list[dict[str, Any]]],
                                               sets: tuple[str, ...], namespaces: list[str],
                                               flags: set[str]):
    import kubernetes_validate

    kinds = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    rbac_objects = [o for o in render(sets=sets) if o["kind"] in kinds]
    assert rbac_objects
    for obj in rbac_objects:
        kubernetes_validate.validate(obj, "1.34", strict=True)


def test_named_namespaces_get_no_cluster_wide_grant(render: Callable[..., list[dict[str, Any]]]):
    kinds = {o["kind"] for o in render(sets=("operator.watchNamespaces={team-a}",
                                             "replicaCount=2"))}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}
    assert grants(["team-a"], {"--peering", "--leader-worker-set"}).keys() == {"team-a"}


def test_rbac_create_false_renders_no_rbac(render: Callable[..., list[dict[str, Any]]]):
    for sets in ((), ("operator.watchNamespaces={team-a}",)):
        kinds = {o["kind"] for o in render(sets=("rbac.create=false", *sets))}
        assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


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


def test_kopf_scans_nothing_cluster_wide():
    """With scanning off kopf lists neither CRDs nor namespaces: the table needs neither."""
    from kvpilot.operator.handlers.lifecycle import operator_settings

    assert operator_settings().scanning.disabled
    assert not {r for r in verbs_by_resource() if r[1] in ("customresourcedefinitions",
                                                          "namespaces")}


@pytest.mark.parametrize(("sets", "namespaces", "flags"), MODES, ids=IDS)
def test_secrets_are_create_only_and_pod_patches_stay_in_watched_namespaces(
        render: Callable[..., list[dict[str, Any]]], sets: tuple[str, ...],
        namespaces: list[str], flags: set[str]):
    """The operator may create the fleet Secrets but never read or overwrite any Secret; it
    may patch pods (pod-deletion-cost) only where it watches."""
    roles = granted(render(sets=sets))
    for holder, table in roles.items():
        assert table[("", "secrets")] == {"create"}, holder
        assert ("networking.k8s.io", "networkpolicies") in table, holder
        if "patch" in table.get(("", "pods"), set()):
            assert holder in (namespaces or [None]), holder
