"""Simulation acceptance: step response, no flapping, diurnal savings, budget, determinism."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvpilot.operator.autoscale.sim.calibration import load
from kvpilot.operator.autoscale.sim.fleet import (
    SimConfig,
    aggregated_specs,
    simulate,
    static_for_peak,
)
from kvpilot.operator.autoscale.sim.report import (
    direction_changes,
    first_scale_up_after,
    summarize,
)
from kvpilot.operator.autoscale.sim.traces import profile


def run(**kwargs):
    cfg = SimConfig(**kwargs)
    trace = simulate(cfg)
    return trace, summarize(trace, cfg.workload, cfg.cost)


def test_four_fold_step_is_answered_within_30_seconds() -> None:
    trace, _ = run(trace="step", duration_s=1200, step_at_s=600, peak_rps=200)
    latency = first_scale_up_after(trace.events, 600)
    assert latency is not None and latency <= 30, trace.events[:5]
    assert trace.replicas[-1].sum() > trace.replicas[500].sum() * 2


def test_noisy_steady_load_does_not_flap() -> None:
    _, report = run(trace="steady", duration_s=3600, peak_rps=200, models=4, seed=3)
    assert report.max_direction_changes_per_5min <= 1
    assert report.slo_attainment >= 0.95


def test_diurnal_meets_slo_with_30_percent_fewer_gpu_hours_than_static_peak() -> None:
    cfg = SimConfig(trace="diurnal", duration_s=86_400, tick_s=4.0, peak_rps=400)
    trace = simulate(cfg)
    auto = summarize(trace, cfg.workload, cfg.cost)
    _, static = run(trace="diurnal", duration_s=86_400, tick_s=4.0, peak_rps=400,
                    static_replicas=static_for_peak(trace, cfg))
    assert auto.slo_attainment >= 0.95, auto
    assert static.slo_attainment >= 0.95, static  # the baseline is a fair one
    assert auto.gpu_hours <= 0.7 * static.gpu_hours, (auto, static)
    assert static.scale_events == 0


def test_aggregated_pools_step_and_day() -> None:
    """One "both" pool per model: the same step response and diurnal savings hold."""
    step, _ = run(trace="step", duration_s=1200, peak_rps=400, aggregated=True,
                  specs=aggregated_specs())
    assert 0 <= first_scale_up_after(step.events, 600) <= 30
    assert step.replicas[:, 0].max() == 0  # no prefill pool
    cfg = SimConfig(trace="diurnal", tick_s=4.0, peak_rps=400, aggregated=True,
                    specs=aggregated_specs())
    trace = simulate(cfg)
    auto = summarize(trace, cfg.workload, cfg.cost)
    _, static = run(trace="diurnal", tick_s=4.0, peak_rps=400, aggregated=True,
                    specs=aggregated_specs(), static_replicas=static_for_peak(trace, cfg))
    assert auto.slo_attainment >= 0.95 and static.slo_attainment >= 0.95
    assert auto.gpu_hours <= 0.7 * static.gpu_hours, (auto, static)


def test_gpu_budget_caps_each_model() -> None:
    trace, report = run(trace="step", duration_s=1200, peak_rps=200, gpu_budget=14)
    assert trace.replicas.sum(axis=1).max() <= 14
    assert report.scale_events > 0


def test_same_seed_same_run_other_seed_other_run() -> None:
    a, _ = run(trace="bursty", duration_s=1800, seed=7, models=3)
    b, _ = run(trace="bursty", duration_s=1800, seed=7, models=3)
    c, _ = run(trace="bursty", duration_s=1800, seed=8, models=3)
    assert a.events == b.events
    np.testing.assert_array_equal(a.admitted_cum, b.admitted_cum)
    assert not np.array_equal(a.arrivals, c.arrivals)


def test_overload_without_autoscaler_misses_the_slo() -> None:
    """The SLO measure can fail: a static fleet sized for a quarter of a 4x step misses it."""
    _, report = run(trace="step", duration_s=1200, peak_rps=200,
                    static_replicas=(np.array([4]), np.array([2])))
    assert report.slo_attainment < 0.6


@pytest.mark.parametrize(("events", "expected"), [
    ([], 0),
    ([(0, 0, 0, 1, 2, ""), (100, 0, 0, 2, 3, "")], 0),
    ([(0, 0, 0, 1, 2, ""), (100, 0, 0, 2, 1, ""), (200, 0, 0, 1, 2, "")], 2),
    ([(0, 0, 0, 1, 2, ""), (100, 0, 0, 2, 1, ""), (500, 0, 0, 1, 2, "")], 1),
    ([(0, 0, 0, 1, 2, ""), (100, 1, 0, 2, 1, ""), (200, 0, 1, 1, 2, "")], 0),
])
def test_direction_changes_table(events, expected) -> None:
    assert direction_changes(events) == expected


@pytest.mark.parametrize(("kind", "lo", "hi"), [
    ("diurnal", 0.2, 1.0), ("step", 0.25, 1.0), ("bursty", 0.4, 1.2), ("steady", 0.3, 0.8)])
def test_trace_ranges(kind, lo, hi) -> None:
    shape = profile(kind, 86_400, 1.0, np.random.default_rng(0))
    assert shape.min() >= lo - 1e-9 and shape.max() <= hi + 1e-9
    if kind in ("diurnal", "step"):
        assert shape.max() / shape.min() == pytest.approx(5.0 if kind == "diurnal" else 4.0)


def test_calibration_rejects_unknown_keys(tmp_path) -> None:
    path = tmp_path / "c.json"
    raw = load().to_json() | {"prefill_tps": 1}
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unknown key\\(s\\) prefill_tps"):
        load(path)
    path.write_text(json.dumps(load().to_json()))
    assert load(path) == load()
