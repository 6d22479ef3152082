"""bench/spec_decode_gpu.py runs end to end on CPU with a tiny shape, so the GPU run the lead
makes only has to change the device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_spec_decode_bench_smoke(tmp_path: Path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "spec_decode_gpu.py"),
                           str(tmp_path), "--smoke", "--noise", "0.05"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    scenarios = {row["scenario"] for row in report["rows"]}
    assert scenarios == {"base", "draft=target", "noised-0.05", "ngram"}
    assert len(report["rows"]) == 4 * 2 * 2  # scenarios x prompt kinds x batch sizes
    base = {(r["prompt"], r["batch"]): r["outputs"] for r in report["rows"]
            if r["scenario"] == "base"}
    for row in report["rows"]:
        assert row["tok_per_s"] > 0
        # greedy: speculation never changes the output (fp32 on CPU)
        assert row["outputs"] == base[(row["prompt"], row["batch"])], row["scenario"]
        if row["scenario"] == "draft=target":
            assert row["acceptance"] == 1.0
    assert "| draft=target | random | 1 |" in (tmp_path / "results.md").read_text()


def test_spec_decode_bench_small_draft_smoke(tmp_path: Path):
    # a draft of the target's first layer against a target whose second layer is damped to
    # nothing: the draft then proposes the target's own tokens (undamped, it does not)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "spec_decode_gpu.py"),
                           str(tmp_path), "--smoke", "--scenarios", "base,small-draft",
                           "--small-draft-layers", "1", "--damp", "0"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    rows = [r for r in report["rows"] if r["scenario"] == "small-draft"]
    base = {(r["prompt"], r["batch"]): r["outputs"] for r in report["rows"]
            if r["scenario"] == "base"}
    assert len(rows) == 4 and report["damp"] == 0.0
    for row in rows:
        assert row["outputs"] == base[(row["prompt"], row["batch"])]
        assert row["acceptance"] == 1.0
