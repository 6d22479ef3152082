"""helm lint --strict, helm template objects valid for Kubernetes 1.34, and the values schema."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from chart_helpers import CHART, CI_VALUES, run_helm

VALUE_SETS = [None, *CI_VALUES]
IDS = ["default", *[p.stem for p in CI_VALUES]]
# Kinds of CRDs that are not part of Kubernetes: checked by hand below, not by the 1.34 schemas.
FOREIGN = {
    "PodMonitor": "monitoring.coreos.com/v1",
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "ClusterKopfPeering": "kopf.dev/v1",
    "KopfPeering": "kopf.dev/v1",
}


@pytest.mark.parametrize("values", VALUE_SETS, ids=IDS)
def test_lint_strict(helm: Path, values: Path | None):
    args = ["lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
    done = run_helm(helm, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout


@pytest.mark.parametrize("values", VALUE_SETS, ids=IDS)
def test_rendered_objects_validate(render: Callable[..., list[dict[str, Any]]],
                                   values: Path | None):
    import kubernetes_validate

    objects = render(*([values] if values else []))
    assert {o["kind"] for o in objects} >= {"Deployment"}
    for obj in objects:
        if obj["kind"] in FOREIGN:
            assert obj["apiVersion"] == FOREIGN[obj["kind"]]
            assert obj["metadata"]["name"]
            continue
        kubernetes_validate.validate(obj, "1.34", strict=True)


def test_default_install_objects(render: Callable[..., list[dict[str, Any]]]):
    kinds = sorted(o["kind"] for o in render())
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap",
                     *["CustomResourceDefinition"] * 3, "Deployment", "ServiceAccount"]


def test_standbys_get_peering_and_a_disruption_budget(render: Callable[..., list[dict[str, Any]]]):
    kinds = sorted(o["kind"] for o in render(sets=("replicaCount=2",)))
    assert kinds == ["ClusterKopfPeering", "ClusterRole", "ClusterRoleBinding", "ConfigMap",
                     *["CustomResourceDefinition"] * 5, "Deployment",
                     "PodDisruptionBudget", "ServiceAccount"]


def _args(objects: list[dict[str, Any]]) -> list[str]:
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(("values", "present", "absent"), [
    (None, ["operator", "--liveness=8080", "--engine-image=ghcr.io/kvpilot/engine:0.1.0",
            "--router-image=ghcr.io/kvpilot/operator:0.1.0"],
     ["--peering=kv-kvpilot", "--leader-worker-set", "--inference-pool"]),
    (CHART / "ci" / "peering-values.yaml", ["--peering=kv-kvpilot", "--leader-worker-set"], []),
    (CHART / "ci" / "namespaced-values.yaml",
     ["--namespace=team-a", "--namespace=team-b", "--dev",
      "--engine-image=registry.example.com/kvpilot/engine-rocm:0.1.0"], []),
], ids=["default", "peering", "namespaced"])
def test_operator_flags(render: Callable[..., list[dict[str, Any]]], values: Path | None,
                        present: list[str], absent: list[str]):
    args = _args(render(*([values] if values else [])))
    assert all(a in args for a in present), args
    assert not any(a in args for a in absent), args


@pytest.mark.parametrize("values", VALUE_SETS, ids=IDS)
def test_rendered_args_parse_as_kvpilot_operator(render: Callable[..., list[dict[str, Any]]],
                                                 values: Path | None):
    """The container args are exactly what `kvpilot operator` accepts."""
    from kvpilot.cli.main import build_parser

    args = _args(render(*([values] if values else [])))
    parsed = build_parser("operator").parse_args(args)
    assert parsed.command == "operator" and parsed.liveness == 8080


@pytest.mark.parametrize(("values_yaml", "message"), [
    ("replicaCount: 0\n", "at '/replicaCount': minimum: got 0, want 1"),
    ("operator:\n  leaderWorkerSets: true\n",
     "at '/operator': additional properties 'leaderWorkerSets' not allowed"),
    ("image:\n  pullPolicy: Sometimes\n", "at '/image/pullPolicy': value must be one of"),
    ("monitoring:\n  podMonitor:\n    interval: soon\n", "at '/monitoring/podMonitor/interval'"),
    ("rbac: true\n", "at '/rbac': got boolean, want object"),
], ids=["replicas", "typo", "enum", "pattern", "type"])
def test_schema_rejects_bad_values(helm: Path, tmp_path: Path, values_yaml: str, message: str):
    values = tmp_path / "bad.yaml"
    values.write_text(values_yaml)
    done = run_helm(helm, "template", "kv", str(CHART), "-f", str(values))
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


def test_dashboard_configmap_is_labelled(render: Callable[..., list[dict[str, Any]]]):
    dashboards = [o for o in render() if o["kind"] == "ConfigMap"
                  and o["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert [d["metadata"]["name"] for d in dashboards] == ["kv-kvpilot-dashboard"]
    assert "kvpilot.json" in dashboards[0]["data"]


def test_restricted_security_context(render: Callable[..., list[dict[str, Any]]]):
    deployment = next(o for o in render() if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
