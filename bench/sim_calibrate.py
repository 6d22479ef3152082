"""Refreshes the simulator's cost model from the engine's recorded GPU benchmarks.

Preferred source: bench/results/sim_engine_<card>.json (bench/sim_engine_gpu.py: prefill
tokens/s, the decode step fitted over batch and context, the KV capacity). Fallback:
e2e_gpu_d_<card>.json (batch-1 ms per token) and e2e_gpu_c_<card>.json (throughput with
up to 256 sequences), a two-point fit with the KV-read term folded into the slope.
Keys no benchmark measures (pod start-up time; the benchmarks load dummy weights)
keep the packaged calibration.json's values, and `source` says which is which.

    .venv/bin/python bench/sim_calibrate.py [--card h200] [--write]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from kvpilot.operator.autoscale.sim.calibration import DEFAULT_PATH, load

RESULTS = Path(__file__).resolve().parent / "results"


def measured(card: str) -> dict[str, object] | None:
    """Gives the calibration fields bench/sim_engine_gpu.py measured on `card` (None: no run)."""
    path = RESULTS / f"sim_engine_{card}.json"
    if not path.exists():
        return None
    run = json.loads(path.read_text())
    fit = run["decode_fit"]
    return {
        "prefill_tokens_per_s": round(run["prefill_tokens_per_s"], 1),
        "decode_step_base_s": round(fit["base_s"], 6),
        "decode_step_per_seq_s": round(fit["per_seq_s"], 9),
        "decode_step_per_kv_token_s": round(fit["per_kv_token_s"], 12),
        "kv_capacity_tokens": int(run["kv_capacity_tokens"]),
        "max_num_seqs": int(run["max_num_seqs"]),
        "source": (f"measured by bench/sim_engine_gpu.py on {run['gpu']}, {run['date']} "
                   f"({run['model']}): prefill {run['prefill_tokens_per_s']:.0f} tokens/s, "
                   "decode step fitted over batch 1-256 and context 256-2048, KV capacity at "
                   "gpu_memory_utilization 0.9; startup_s (60) is the documented model's "
                   "(pod scheduling, image and weight loading are not benchmarked)"),
    }


def fitted(card: str) -> dict[str, object]:
    """Gives the decode fields the end-to-end benchmarks of `card` determine, with their source."""
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
    new = replace(load(), **(measured(args.card) or fitted(args.card)))
    text = json.dumps(new.to_json(), indent=2) + "\n"
    print(text)
    if args.write:
        Path(DEFAULT_PATH).write_text(text)
        print(f"wrote {DEFAULT_PATH}")


if __name__ == "__main__":
    main()
