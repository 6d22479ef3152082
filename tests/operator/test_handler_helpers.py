"""Pure helpers of the handlers: REST paths, merge-patch diffs, events, RBAC table, CLI flags."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.operator import cli, rbac
from kvpilot.operator.handlers.events import event
from kvpilot.operator.kube.client import resource_path
from kvpilot.operator.kube.diff import differs, without
from kvpilot.operator.kube.errors import KubeError, transient

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("args", "path"), [
    (("v1", "Service", "ns", "a"), "/api/v1/namespaces/ns/services/a"),
    (("apps/v1", "Deployment", "ns", None), "/apis/apps/v1/namespaces/ns/deployments"),
    (("kvpilot.dev/v1alpha1", "DecodePool", "ns", "p", "status"),
     "/apis/kvpilot.dev/v1alpha1/namespaces/ns/decodepools/p/status"),
    (("policy/v1", "PodDisruptionBudget", "ns", "p"),
     "/apis/policy/v1/namespaces/ns/poddisruptionbudgets/p"),
    (("v1", "Namespace", None, "ns"), "/api/v1/namespaces/ns"),
    (("networking.k8s.io/v1", "NetworkPolicy", "ns", "p"),
     "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies/p"),
    (("v1", "Secret", "ns", "s"), "/api/v1/namespaces/ns/secrets/s"),
])
def test_resource_path(args, path):
    assert resource_path(*args) == path


@pytest.mark.parametrize(("current", "desired", "changed"), [
    ({"a": 1, "b": 2}, {"a": 1}, False),  # extra server fields do not count
    ({"a": {"x": 1, "y": 2}}, {"a": {"x": 1}}, False),
    ({"a": {"x": 1}}, {"a": {"x": 2}}, True),
    ({"a": [1, 2]}, {"a": [1]}, True),  # lists are replaced whole by a merge patch
    ({"a": [{"x": 1, "default": 0}]}, {"a": [{"x": 1}]}, False),  # server-filled defaults
    ({"a": [{"x": 1}]}, {"a": [{"x": 2}]}, True),
    ({"a": [1, 2]}, {"a": [2, 1]}, True),
    ({}, {"a": None}, False),
    ({"a": 1}, {"b": 1}, True),
])
def test_differs(current, desired, changed):
    assert differs(current, desired) is changed


json_values = st.recursive(st.integers() | st.text(max_size=3),
                           lambda inner: st.dictionaries(st.text(max_size=3), inner, max_size=3),
                           max_leaves=10)


@given(st.dictionaries(st.text(max_size=3), json_values, max_size=4))
def test_an_object_never_differs_from_itself(obj):
    assert not differs(obj, obj)


def test_without_removes_nested_keys_and_leaves_the_input_alone():
    obj = {"spec": {"replicas": 3, "role": "both"}, "kind": "DecodePool"}
    assert without(obj, [("spec", "replicas"), ("status", "x")]) == {
        "spec": {"role": "both"}, "kind": "DecodePool"}
    assert obj["spec"]["replicas"] == 3


@pytest.mark.parametrize(("exc", "retry"), [
    (KubeError("PATCH", "/x", 409, "conflict"), True),
    (KubeError("POST", "/x", 429, "slow down"), True),
    (KubeError("POST", "/x", 503, "down"), True),
    (KubeError("POST", "/x", 422, '{"message": "spec.template: Invalid"}'), False),
    (KubeError("POST", "/x", 403, "forbidden"), False),
    (TimeoutError(), True),
])
def test_transient(exc, retry):
    assert transient(exc) is retry


def test_kube_error_message_names_verb_path_and_server_message():
    err = KubeError("POST", "/api/v1/x", 422, '{"message": "spec.ports: Required value"}')
    assert str(err) == "POST /api/v1/x failed with HTTP 422: spec.ports: Required value"


def test_event_refers_to_the_object():
    obj = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
           "metadata": {"name": "m", "namespace": "ns", "uid": "u"}}
    ev = event(obj, "InvalidSpec", "topology.tensorParallel=3 ...", warning=True,
               now="2026-01-01T00:00:00Z")
    assert ev["involvedObject"] == {"apiVersion": "kvpilot.dev/v1alpha1",
                                    "kind": "InferenceModel", "name": "m", "namespace": "ns",
                                    "uid": "u"}
    assert (ev["type"], ev["reason"], ev["metadata"]["generateName"]) == (
        "Warning", "InvalidSpec", "m.")


def _decorated_resources() -> set[tuple[str, str]]:
    """Gives (group, plural) of every kopf decorator in operator/handlers/."""
    found: set[tuple[str, str]] = set()
    for path in (REPO / "operator" / "kvpilot" / "operator" / "handlers").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and ast.unparse(node.func).startswith(("kopf.on.", "kopf.index")) \
                    and len(node.args) == 3:
                group, _, plural = (ast.unparse(a).strip("'\"") for a in node.args)
                found.add(({"GROUP": "kvpilot.dev"}.get(group, group), plural))
    return found


def test_every_watched_resource_has_list_and_watch_in_the_rbac_table():
    verbs = rbac.verbs_by_resource()
    watched = _decorated_resources()
    assert watched >= {("kvpilot.dev", "inferencemodels"), ("apps", "deployments")}
    for resource in watched:
        assert {"list", "watch"} <= verbs[resource], resource


def test_every_kind_the_handlers_apply_and_prune_is_in_the_rbac_table():
    from kvpilot.operator.handlers.inference_model import OWNED_KINDS
    from kvpilot.operator.handlers.pools import workload_kinds
    from kvpilot.operator.render.meta import RenderConfig

    verbs = rbac.verbs_by_resource()
    kinds = [*OWNED_KINDS, *workload_kinds(RenderConfig(leader_worker_set=True)),
             ("policy/v1", "PodDisruptionBudget")]
    for api_version, kind in kinds:
        group = api_version.rpartition("/")[0]
        plural = kind.lower().removesuffix("y") + ("ies" if kind.endswith("y") else "s")
        assert {"create", "patch", "list", "delete"} <= verbs[(group, plural)]


def test_cli_flags():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["-n", "a", "-n", "b", "--liveness", "8080", "--dev",
                              "--engine-image", "img:1", "--leader-worker-set"])
    assert (args.namespace, args.liveness, args.dev) == (["a", "b"], 8080, True)
    config = cli.render_config(args)
    assert (config.engine_image, config.leader_worker_set) == ("img:1", True)
    with pytest.raises(SystemExit):
        parser.parse_args(["-n", "a", "-A"])
    with pytest.raises(SystemExit):  # patterns: RBAC is granted per named namespace
        parser.parse_args(["-n", "team-*"])


def test_operator_cli_import_loads_neither_kopf_nor_torch():
    code = ("import sys, kvpilot.operator.cli, kvpilot.operator.render.children; "
            "print('kopf' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]
