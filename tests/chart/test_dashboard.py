"""The Grafana dashboard covers the documented signals with metrics the engine exports."""

from __future__ import annotations

import json
import re

from chart_helpers import CHART

from kvpilot.engine.contracts import metric_names

DASHBOARD = json.loads((CHART / "files" / "dashboards" / "kvpilot.json").read_text())
EXPORTED = {v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)}
# prometheus_client exposes counters with _total and histograms with _bucket/_sum/_count.
SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def _metrics(expr: str) -> set[str]:
    names = set(re.findall(r"((?:vllm:|kvpilot_)[a-z_:]+)\{", expr))
    return {next((n.removesuffix(s) for s in SUFFIXES if n.endswith(s)), n) for n in names}


def test_every_query_uses_exported_metrics():
    used = set()
    for panel in DASHBOARD["panels"]:
        for target in panel["targets"]:
            names = _metrics(target["expr"])
            assert names, target["expr"]
            used |= names
    assert used <= EXPORTED, used - EXPORTED


def test_panels_cover_the_documented_signals():
    titles = " | ".join(p["title"] for p in DASHBOARD["panels"])
    for signal in ("KV-cache usage", "Queue depth", "Time to first token p50 / p99",
                   "Inter-token latency p50 / p99", "Throughput", "replicas per pool",
                   "Scale decisions"):
        assert signal in titles, signal


def test_panel_ids_unique_and_grid_does_not_overlap():
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in DASHBOARD["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))
