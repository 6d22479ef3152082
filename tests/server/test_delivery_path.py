"""bench/delivery_path.py end to end on CPU (its smoke mode): the real core process serving the
paced fake engine, a real API server process and real load generators. Not a measurement: it
checks that the harness runs and that what it reports adds up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench" / "delivery_path.py"


@pytest.mark.slow
def test_delivery_path_smoke_reports_itl_and_cpu(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--smoke", "--period-ms", "20",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "delivery_path.json").read_text())
    summary = report["summary"]
    # every stream got all its tokens, one per step of the paced core
    assert summary["completed"] == report["streams"] and summary["failed"] == 0
    assert summary["total_output_tokens"] == report["streams"] * report["tokens"]
    # no ITL can be shorter than a period by much (steps start 20 ms apart), and the median
    # chunk carries one token
    assert report["itl_p50_ms"] >= 0.5 * report["period_ms"]
    assert report["itl_p99_ms"] >= report["itl_p50_ms"]
    assert report["tokens_per_chunk"] >= 0.9
    assert min(report["api_server_cpu_us_per_token"], report["loadgen_cpu_us_per_token"]) > 0
    assert report["core_cpu_us_per_token"] >= 0
    [gc_pauses] = report["api_server_gc"]  # one API server process
    assert {"gen0_count", "gen2_max_ms"} <= set(gc_pauses)
    assert "| 8 x 16, 20 ms, 1 API server(s) |" in done.stdout
