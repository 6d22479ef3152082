"""bench/long_prefill_gpu.py on CPU (--smoke, Triton's interpreter): each chunk of the prompt
attends its cached prefix correctly, and the chunks' FLOPs add up to the whole prompt's causal
attention, which the SDPA baseline runs unchunked. A CUDA host skips it: the bench runs there."""

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
def test_long_prefill_bench_smoke(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "long_prefill_gpu.py"),
                           "--out", str(tmp_path), "--smoke"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    kernel = json.loads((tmp_path / "long_prefill.json").read_text())["kernel"]
    chunks = kernel["chunks"]
    assert [c["prefix"] for c in chunks] == [0, 32, 64] and kernel["tokens"] == 96
    assert all(c["triton_rel_err_vs_ref"] < 1e-4 for c in chunks)
    assert kernel["flops"] == pytest.approx(kernel["whole_prompt_flops"])
    assert kernel["sdpa_best_tflops"] > 0 and kernel["triton_tflops"] > 0
