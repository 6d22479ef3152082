"""bench/lora_gpu.py end to end on CPU (its smoke mode): the three modes run, the adapters
are used, and the ratio lands in results.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_lora_bench_smoke(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "lora_gpu.py"), str(tmp_path),
                           "--smoke"], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == ["base", "lora_base", "lora8"]
    assert all(r["pure_decode_steps"] > 0 and r["output_tok_per_s"] > 0 for r in rows.values())
    assert rows["base"]["adapters_running_at_end"] == ["base"]
    assert len(rows["lora8"]["adapters_running_at_end"]) == 4  # batch 4 over 4 adapters
    assert result["ratio_tok_per_s"] > 0
