"""`kvpilot sim`: the report it prints and writes, and the PNG it draws."""

from __future__ import annotations

import json

from kvpilot.cli.main import main


def test_sim_step_writes_report_and_png(tmp_path, capsys) -> None:
    png, out = tmp_path / "step.png", tmp_path / "step.json"
    code = main(["sim", "--trace", "step", "--duration", "900", "--step-at", "300",
                 "--compare-static", "--png", str(png), "--json", str(out)])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert 0 <= printed["first_scale_up_after_step_s"] <= 30
    assert set(printed["autoscaled"]) == {"requests", "slo_attainment", "gpu_hours",
                                          "scale_events", "max_direction_changes_per_5min",
                                          "peak_replicas"}
    # the pools by name: it printed `peak_replicas: [7, 5]` (issue 49)
    assert set(printed["autoscaled"]["peak_replicas"]) == {"prefill", "decode"}
    assert printed["static_for_peak"]["scale_events"] == 0
    assert isinstance(printed["gpu_hours_saved"], float)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_rejects_a_calibration_with_unknown_keys(tmp_path, capsys) -> None:
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"prefill_tps": 1}))
    assert main(["sim", "--duration", "60", "--calibration", str(bad)]) == 2
    assert "unknown key(s) prefill_tps" in capsys.readouterr().err


def test_sim_aggregated_has_no_prefill_pool(capsys) -> None:
    assert main(["sim", "--aggregated", "--trace", "steady", "--duration", "600"]) == 0
    printed = json.loads(capsys.readouterr().out)
    peak = printed["autoscaled"]["peak_replicas"]
    assert list(peak) == ["both"] and peak["both"] >= 1


def labels(axes) -> list[str]:
    legend = axes.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def test_the_plot_names_every_line_and_shows_ready_under_spec() -> None:
    """The plot had two panels, and its dashed "ready" lines hid under "spec" (issue 49)."""
    from kvpilot.operator.autoscale.sim.fleet import SimConfig, Workload, simulate
    from kvpilot.operator.autoscale.sim.plot import figure

    trace = simulate(SimConfig(trace="step", duration_s=900, step_at_s=300))
    fig = figure(trace, "step", Workload(ttft_slo_s=2.0, itl_slo_s=0.05))
    load, pools, latency, within, gpus = fig.axes
    assert [a.get_ylabel() for a in fig.axes] == [
        "requests/s", "replicas", "latency / SLO", "within SLO", "GPU-hours"]
    assert labels(load) == ["arrivals, all models"]
    assert labels(pools) == ["prefill: ready (serving)",
                             "prefill: spec (GPUs held, starting pods included)",
                             "decode: ready (serving)",
                             "decode: spec (GPUs held, starting pods included)"]
    ready, spec = pools.get_lines()[:2]  # ready drawn first and wider: spec never covers it
    assert ready.get_linewidth() > 2 * spec.get_linewidth()
    assert labels(latency) == ["decode step (ITL) / 50 ms",
                               "prefill wait + compute / TTFT SLO 2 s", "SLO"]
    assert labels(within) == ["requests within TTFT 2 s and ITL 50 ms"]
    assert labels(gpus) == ["GPU-hours so far (1 GPU(s) per replica)"]
    # the attainment dips during the step's scale-up and is 1 before it
    share = within.get_lines()[0].get_ydata()
    assert share[0] == 1.0 and min(share) < 1.0
