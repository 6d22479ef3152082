"""The chart ships the very CRDs `kvpilot crds` generates, as templates `helm upgrade` updates.

Helm installs a chart's crds/ folder once and never upgrades it; kvpilot's CRDs are
templates instead (templates/crds.yaml over files/crds/), kept on uninstall.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, ROOT, run_helm


def repository_crds() -> dict[str, dict[str, Any]]:
    return {(crd := yaml.safe_load(p.read_text()))["metadata"]["name"]: crd
            for p in sorted((ROOT / "crds").glob("*.yaml"))}


def test_chart_crd_files_equal_repository_crds():
    repo = {p.name: p.read_text() for p in sorted((ROOT / "crds").glob("*.yaml"))}
    chart = {p.name: p.read_text() for p in sorted((CHART / "files" / "crds").glob("*.yaml"))}
    assert len(repo) == 3
    assert chart == repo, "stale chart CRDs: run scripts/gen_crds.sh and commit the result"
    assert not (CHART / "crds").exists(), "Helm would install crds/ once and never upgrade it"


def _kvpilot_crds(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects
            if o["kind"] == "CustomResourceDefinition" and o["spec"]["group"] == "kvpilot.dev"}


def test_an_upgrade_renders_the_current_crds_kept_on_uninstall(helm: Path):
    done = run_helm(helm, "template", "kv", str(CHART), "--namespace", "kvpilot-system",
                    "--is-upgrade")
    assert done.returncode == 0, done.stderr
    rendered = _kvpilot_crds([d for d in yaml.safe_load_all(done.stdout) if d])
    expected = repository_crds()
    assert rendered.keys() == expected.keys()
    for name, crd in rendered.items():
        meta = crd["metadata"]
        assert meta.pop("annotations") == {"helm.sh/resource-policy": "keep"}
        assert meta.pop("labels")["app.kubernetes.io/managed-by"] == "Helm"
        assert crd == expected[name], name


def test_crds_install_false_leaves_them_to_kubectl(render: Callable[..., list[dict[str, Any]]]):
    assert not _kvpilot_crds(render(sets=("crds.install=false",)))


@pytest.mark.parametrize("name", sorted(repository_crds()))
def test_each_crd_has_one_storage_version_and_serves_it(name: str):
    """Conversion-ready: adding v1beta1 later means one more served version and moving
    storage, with no ambiguity about which version etcd holds today."""
    versions = repository_crds()[name]["spec"]["versions"]
    assert [v["name"] for v in versions if v["storage"]] == ["v1alpha1"]
    assert all(v["served"] for v in versions)
