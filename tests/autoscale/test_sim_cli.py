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
    assert printed["autoscaled"]["peak_replicas"][0] == 0
    assert printed["autoscaled"]["peak_replicas"][1] >= 1
