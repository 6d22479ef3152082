"""bench/kernels/attention_bench.py's prefill path on CPU (--smoke, Triton's interpreter): every
SDPA backend is tried and named, the fastest that ran is the baseline. A CUDA host skips it:
there the smoke run timed none of kvpilot's kernel configurations (H100, 2026-11-27, also
with the GPU hidden from the child), and the benchmark itself runs (bench/kernels/run_gpu.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).parents[2]


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter's smoke run is for CPU hosts; a GPU runs the bench")
def test_attention_bench_smoke_names_every_sdpa_backend(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "kernels" / "attention_bench.py"),
                           "--out", str(tmp_path), "--smoke"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    (case,) = json.loads((tmp_path / "attention.json").read_text())["prefill"]
    names = [r["backend"] for r in case["sdpa_backends"]]
    assert names == ["default", "CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"]
    ran = [r for r in case["sdpa_backends"] if "ms" in r]
    assert ran and all(r["rel_err_vs_first"] < 1e-4 for r in ran)
    assert case["sdpa_ms"] == min(r["ms"] for r in ran)  # the fastest is the baseline
    assert case["best"]["rel_err_vs_sdpa"] < 1e-4  # kvpilot's kernel agrees with SDPA
    assert "(fastest)" in (tmp_path / "attention.md").read_text()
