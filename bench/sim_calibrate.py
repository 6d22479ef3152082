"""Refreshes the simulator's cost model from the engine's recorded GPU benchmarks.

Reads bench/results/e2e_gpu_d_*.json (batch-1 decode ms per token) and
e2e_gpu_c_*.json (throughput with up to 256 running sequences) and fits the
decode step as base + slope × batch through those two points; the KV-read term
is folded into the slope (the throughput run's context is what it is). Keys no
benchmark measures yet (prefill tokens/s, KV capacity, start-up time) keep the
values of the packaged calibration.json, and `source` says which is which.

    .venv/bin/python bench/sim_calibrate.py [--card h200] [--write]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from kvpilot.operator.autoscale.sim.calibration import DEFAULT_PATH, load

RESULTS = Path(__file__).resolve().parent / "results"


def fitted(card: str) -> dict[str, object]:
    """Gives the calibration fields the benchmarks of `card` determine, with their source."""
    batch1 = json.loads((RESULTS / f"e2e_gpu_d_{card}.json").read_text())
    thr = json.loads((RESULTS / f"e2e_gpu_c_{card}.json").read_text())
    base_s = batch1["batch1"]["engine_ms_per_token"] / 1000
    run = thr["throughput"]["kvpilot"]
    batch = 256  # the throughput run keeps up to 256 sequences in flight
    step_s = batch / run["output_tok_per_s"]
    return {
        "decode_step_base_s": round(base_s, 6),
        "decode_step_per_seq_s": round((step_s - base_s) / (batch - 1), 8),
        "decode_step_per_kv_token_s": 0.0,
        "source": (f"decode step fitted to bench/results/e2e_gpu_d_{card}.json (batch 1: "
                   f"{base_s * 1000:.2f} ms) and e2e_gpu_c_{card}.json ({batch} sequences: "
                   f"{run['output_tok_per_s']:.0f} tok/s) on {thr['gpu']}, {thr['date']}; "
                   "prefill_tokens_per_s, kv_capacity_tokens, max_num_seqs and startup_s are "
                   "the documented model's (not benchmarked yet)"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", default="h200", help="suffix of the result files")
    parser.add_argument("--write", action="store_true", help="rewrite calibration.json")
    args = parser.parse_args()
    new = replace(load(), **fitted(args.card))
    text = json.dumps(new.to_json(), indent=2) + "\n"
    print(text)
    if args.write:
        Path(DEFAULT_PATH).write_text(text)
        print(f"wrote {DEFAULT_PATH}")


if __name__ == "__main__":
    main()
