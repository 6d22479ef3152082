"""bench/decode_recipe_gpu.py on CPU (--smoke, Triton's interpreter): two of the recipe's
decode steps, cut short, through every launch variant and a second kernel file; the script
itself checks that every variant gives the first one's output (a launch order that wrote
rows to the wrong place would fail it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).parents[2]


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter's smoke run is for CPU hosts; a GPU runs the bench")
def test_decode_recipe_bench_smoke_runs_every_variant(tmp_path: Path) -> None:
    kernel = REPO / "kernels" / "kvpilot" / "kernels" / "paged_decode_attention.py"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "decode_recipe_gpu.py"),
                           str(tmp_path), "--smoke", "--before-kernel", str(kernel),
                           "--other-kernel", str(kernel)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "decode_recipe.md").read_text()
    for name in ("before", "row order", "longest-first", "other kernel, longest-first"):
        assert f"| {name} |" in table
