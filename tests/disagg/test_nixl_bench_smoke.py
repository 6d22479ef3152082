"""bench/kv_nixl_gpu.py on CPU (its smoke mode, DRAM registrations): the four transfers run,
the pulls move by the transport each names, and the report carries every rate. Not a
measurement: it checks the script that issue 22's GPU numbers come from still runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.engine.kv_transfer.nixl_agent import NixlUnavailable, nixl_api

BENCH = Path(__file__).parents[2] / "bench" / "kv_nixl_gpu.py"


def test_nixl_bench_smoke_reports_each_transport(tmp_path: Path) -> None:
    try:
        nixl_api()
    except NixlUnavailable as exc:
        pytest.skip(f"nixl is not installed ({exc})")
    done = subprocess.run([sys.executable, str(BENCH), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "kv_nixl_gpu-tiny.json").read_text())
    assert set(report["rates_gb_s"]) == {"tcp", "nixl-pull", "nixl-vram", "nixl-region-vram"}
    assert report["pack_ms"] > 0
    assert all(rate > 0 for rate in report["rates_gb_s"].values())
    assert report["over_tcp"]["tcp"] == 1.0
    assert "| nixl-vram |" in (tmp_path / "kv_nixl_gpu-tiny.md").read_text()
