"""bench/quant_gpu.py runs end to end on CPU with tiny shapes, so the GPU run the lead makes
only has to change the device: every part, and the fp8 KV pool's capacity follows its
bytes (4x the sequences of an fp32 cache)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_quant_bench_smoke(tmp_path: Path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "quant_gpu.py"),
                           str(tmp_path), "--smoke"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    got = {(r["part"], r["label"]): r for r in report["configs"]}
    assert list(got) == [("a", "bf16"), ("a", "int8"), ("b", "bf16"), ("c", "bf16kv"),
                         ("c", "fp8kv")]
    assert got["a", "int8"]["batch1_ms_per_token"] > 0
    assert got["a", "int8"]["weight_bytes"] < got["a", "bf16"]["weight_bytes"]
    assert got["b", "bf16"]["output_tok_per_s"] > 0
    bf16, fp8 = got["c", "bf16kv"], got["c", "fp8kv"]
    assert fp8["num_kv_blocks"] == 4 * bf16["num_kv_blocks"]
    assert fp8["capacity_seqs"] == 4 * bf16["capacity_seqs"]
    assert fp8["peak_running_seqs"] == fp8["capacity_seqs"]
    assert "| c | fp8kv | capacity_seqs |" in (tmp_path / "results.md").read_text()
