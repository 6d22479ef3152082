"""The Argo CD Application examples point at paths that exist and use CRD-friendly sync options."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from chart_helpers import ROOT

APPS = sorted((ROOT / "argocd").glob("*.yaml"))


@pytest.mark.parametrize("path", APPS, ids=[p.stem for p in APPS])
def test_application(path: Path):
    app = yaml.safe_load(path.read_text())
    assert (app["apiVersion"], app["kind"]) == ("argoproj.io/v1alpha1", "Application")
    source = app["spec"]["source"]
    target = ROOT / source["path"]
    assert target.is_dir(), source["path"]
    include = source.get("directory", {}).get("include")
    if include:
        assert (target / include).is_file(), include
    assert "ServerSideApply=true" in app["spec"]["syncPolicy"]["syncOptions"]


def test_operator_application_values_pass_the_chart_schema(helm, tmp_path: Path):
    from chart_helpers import CHART, run_helm

    app = yaml.safe_load((ROOT / "argocd" / "kvpilot-operator.yaml").read_text())
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(app["spec"]["source"]["helm"]["valuesObject"]))
    done = run_helm(helm, "template", "kvpilot", str(CHART), "-f", str(values))
    assert done.returncode == 0, done.stderr
