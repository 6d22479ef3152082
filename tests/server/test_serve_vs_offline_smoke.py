"""bench/serve_vs_offline.py end to end on CPU (its smoke mode): offline, served at rate inf
and at a Poisson rate, and batch 1, each through its real path. Not a measurement: it checks
that the script issue 17's GPU numbers come from still runs and reports every phase."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench" / "serve_vs_offline.py"


@pytest.mark.slow
def test_serve_vs_offline_smoke_reports_every_phase(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--smoke", "--clients", "2",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "serve_vs_offline.json").read_text())
    requests = report["requests"]
    assert report["offline"]["output_tokens"] > 0
    inf, poisson = report["served_inf"]["1"], report["served_poisson"]
    for row in (inf, poisson):
        assert row["summary"]["completed"] == requests and row["summary"]["failed"] == 0
        # the served requests are the offline ones: the same token counts in and out
        assert row["summary"]["total_input_tokens"] == report["offline"]["prompt_tokens"]
        assert row["summary"]["total_output_tokens"] == report["offline"]["output_tokens"]
        assert row["itl_p50_ms"] > 0 and row["itl_p99_ms"] >= row["itl_p50_ms"]
        assert min(row["api_server_cpu_us_per_token"], row["core_cpu_us_per_token"],
                   row["loadgen_cpu_us_per_token"]) > 0
    assert 0 < poisson["request_rate"] < inf["request_rate_reached"]
    batch1 = report["batch1"]
    assert batch1["offline_ms_per_token"] > 0 and batch1["served_ms_per_token"] > 0
    assert batch1["served"]["total_output_tokens"] == batch1["new_tokens"]
    table = (tmp_path / "serve_vs_offline.md").read_text()
    assert "rate inf" in table and "Poisson" in table and "Batch 1" in table
