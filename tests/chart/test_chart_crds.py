"""The chart ships the very CRDs `kvpilot crds` generates."""

from __future__ import annotations

from chart_helpers import CHART, ROOT


def test_chart_crds_equal_repository_crds():
    repo = {p.name: p.read_text() for p in sorted((ROOT / "crds").glob("*.yaml"))}
    chart = {p.name: p.read_text() for p in sorted((CHART / "crds").glob("*.yaml"))}
    assert len(repo) == 3
    assert chart == repo, "stale chart CRDs: run scripts/gen_crds.sh and commit the result"
