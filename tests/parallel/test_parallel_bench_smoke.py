"""bench/parallel_gpu.py runs end to end on CPU with tiny shapes (gloo), so the GPU run
the lead makes only has to change the device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_parallel_bench_smoke(tmp_path: Path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "parallel_gpu.py"),
                           str(tmp_path), "--smoke", "--no-70b"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert [c["tp"] for c in report["configs"]] == [1, 2]
    for config in report["configs"]:
        assert config["batch1_ms_per_token"] > 0 and config["per_gpu_tok_per_s"] > 0
    assert report["configs"][1]["kv_blocks_per_rank"] == \
        2 * report["configs"][0]["kv_blocks_per_rank"]  # half the KV heads per rank
    assert [row["tokens"] for row in report["allreduce"][0]["rows"]] == [1, 1, 64, 64]
    assert "| 8b | tiny | 2 |" in (tmp_path / "results.md").read_text()


def test_step_profile_mixed_steps_smoke(tmp_path: Path):
    # bench/step_profile_gpu.py --chunk: every profiled step prefills a new prompt beside the
    # decodes, and cProfile names where the host's time went
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "step_profile_gpu.py"),
                           str(tmp_path), "--smoke", "--tp", "1", "--steps", "3", "--batch", "2",
                           "--chunk", "5"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [row] = json.loads((tmp_path / "step_profile-b2-c5-bf16.json").read_text())
    assert row["chunk"] == 5 and row["wall_ms_per_step"] > 0
    assert len(row["host_top"]) == 25 and all(h["calls_per_step"] > 0 for h in row["host_top"])
    assert "host, own time per step" in done.stdout
    assert row["first_seen"]["sizes"] == 19  # chunk sizes 1..20 but the warmed 5
    assert row["first_seen"]["first_ms_median"] > 0 < row["first_seen"]["repeat_ms_median"]


def test_tp_profile_smoke(tmp_path: Path):
    # bench/tp_profile_gpu.py: a profiled decode of a batch per TP size, in its own process
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "tp_profile_gpu.py"),
                           str(tmp_path), "--smoke", "--tp", "1", "--batch", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [row] = json.loads((tmp_path / "tp_profile-b2.json").read_text())
    assert row["tp"] == 1 and row["batch"] == 2 and row["tokens"] == 8
    assert row["gpu_busy_ms_per_step"] > 0
    assert row["families_us_per_step"] and len(row["top"]) == 20
