"""Reading kvpilot's metrics back from Prometheus text (torch-free: router and operator use it)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from prometheus_client.parser import text_string_to_metric_families


def read_metrics(text: str, gauges: Collection[str], histograms: Collection[str] = (),
                 labels: Mapping[str, str] | None = None,
                 ) -> tuple[dict[str, float], dict[str, dict[float, float]]]:
    """Gives (gauge sums, histogram bucket counts by upper bound) for the named families.

    Samples are summed over every label set that includes `labels` (e.g. over models,
    or only {"role": "decode"} on the router's page); absent families are absent keys.
    """
    wanted = dict(labels or {})
    sums: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in gauges and family.name not in histograms:
            continue
        for sample in family.samples:
            if not wanted.items() <= sample.labels.items():
                continue
            if family.name in gauges:
                sums[family.name] = sums.get(family.name, 0.0) + sample.value
            elif sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                per = buckets.setdefault(family.name, {})
                per[bound] = per.get(bound, 0.0) + sample.value
    return sums, buckets
