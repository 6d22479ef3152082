"""bench/kv_tier_gpu.py on CPU (its smoke mode): both modes run, the host mode restores the
evicted prompt from host memory, both give the same tokens, the report is written. Not a
measurement: it checks the script issue 22's host-tier TTFT line comes from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "kv_tier_gpu.py"


def test_kv_tier_bench_restores_from_host_and_reports(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "kv_tier_gpu-tiny.json").read_text())
    recompute, host = report["modes"]["recompute"], report["modes"]["host"]
    assert recompute["loaded_blocks"] == 0
    assert host["loaded_blocks"] == report["tokens"] // 16  # every full block of the prompt
    assert host["failed_blocks"] == 0 and report["same_first_tokens"]
    assert report["speedup"] > 0
    assert "restored from host" in (tmp_path / "kv_tier_gpu-tiny.md").read_text()
