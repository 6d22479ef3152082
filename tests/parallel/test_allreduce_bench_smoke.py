"""bench/allreduce_gpu.py runs end to end on CPU (gloo, tiny shapes), so the 2-GPU run the
lead makes (bench/allreduce_gpu_run.sh) only changes the device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_allreduce_bench_smoke(tmp_path: Path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "allreduce_gpu.py"),
                           str(tmp_path), "--smoke", "--configs", "tp2-nccl,tp2-symm-mem"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    latency = report["latency"]
    assert latency["ways"] == ["gloo"]  # no symmetric memory on CPU
    assert [row["bytes"] for row in latency["rows"]] == [8192, 65536]
    assert all(row["gloo_eager_us"] > 0 for row in latency["rows"])
    assert [(c["label"], c["tp"], c["all_reduce"]) for c in report["configs"]] == [
        ("tp2-nccl", 2, "gloo"), ("tp2-symm-mem", 2, "gloo")]
    assert [c["all_reduce_log"][0].split("all-reduce: ")[1] for c in report["configs"]] == [
        "gloo for every message (no symmetric memory: --disable-custom-all-reduce is set)",
        "gloo for every message (no symmetric memory: device cpu: symmetric memory needs CUDA "
        "GPUs)"]  # the driver's start-up line, each run's own reason
    assert all(c["batch1_ms_per_token"] > 0 and c["batch_tok_per_s"] > 0
               for c in report["configs"])
    text = (tmp_path / "results.md").read_text()
    assert report["errors"] == [] and "FAILED" not in text
    assert "| 8 KiB | " in text and "| tp2-nccl | 2 | gloo |" in text
