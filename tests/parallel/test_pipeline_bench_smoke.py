"""bench/pipeline_gpu.py runs end to end on CPU with tiny shapes (gloo), so the GPU run the
lead makes only has to change the device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_pipeline_bench_smoke(tmp_path: Path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "pipeline_gpu.py"),
                           str(tmp_path), "--smoke"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert [(c["label"], c["pp"]) for c in report["configs"]] == [("tp1-eager", 1), ("pp2", 2)]
    for config in report["configs"]:
        assert config["batch1_ms_per_token"] > 0 and config["per_gpu_tok_per_s"] > 0
    assert report["configs"][1]["max_batches_in_flight"] == 2  # the batch of 4 split in two
    assert report["configs"][1]["kv_blocks_per_rank"] == \
        2 * report["configs"][0]["kv_blocks_per_rank"]  # half the layers per stage
    assert "| pp2 | 1 | 2 |" in (tmp_path / "results.md").read_text()
