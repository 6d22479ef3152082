"""bench/disagg_gpu.py end to end on CPU (its smoke mode): both setups, twice, through the
router; the report is written after each run and carries every run's ratios. Not a
measurement: it checks the script that issue 6's GPU numbers come from still runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "disagg_gpu.py"


def test_disagg_bench_runs_both_setups_and_reports_each_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--shape", "tiny", "--seconds", "1",
         "--long-rate", "1", "--decode-rate", "2", "--repeat", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "disagg_gpu-tiny.json").read_text())
    assert len(report["runs"]) == 2
    for run in report["runs"]:
        disagg, agg = run["configs"]["disaggregated"], run["configs"]["aggregated"]
        # every request of both setups answered; the disaggregated one moved KV blocks
        for config in (disagg, agg):
            assert config["decodes"]["failed"] == 0 and config["long_prompts"]["failed"] == 0
            assert config["decodes"]["completed"] > 0
        assert disagg["router_outcomes"].get("transferred_blocks", 0) > 0
        assert disagg["kv_pulls"]["decode"].get("tcp", 0) > 0  # the default transport
        assert run["ratios"]["itl_p99_agg_over_disagg"] > 0
    table = (out / "disagg_gpu-tiny.md").read_text()
    assert "disaggregated, run 2" in table and "per run" in table
