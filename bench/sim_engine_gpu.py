"""Measures the simulator's cost model with the real engine on one GPU (dummy weights).

A Llama-3-8B-shaped model (bench/e2e_gpu.py's) in bf16: prefill tokens/s of 1024-token
prompts; the decode step time over a grid of batch sizes and context lengths, fitted
as base + per_seq·batch + per_kv_token·batch·context; the KV capacity in tokens the
engine allots at gpu_memory_utilization 0.9; and the engine's start-up seconds.
bench/sim_calibrate.py turns the result into calibration.json.

    python bench/sim_engine_gpu.py --out bench/results          # on the GPU
    python bench/sim_engine_gpu.py --smoke --out /tmp           # code paths on CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from e2e_gpu import LLAMA3_8B, fast_dummy_weights, model_dir, sync

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine

GRID = [(1, 1024), (32, 1024), (64, 1024), (128, 1024), (256, 1024), (128, 256), (128, 2048)]
SMOKE_GRID = [(1, 64), (4, 64), (8, 64), (4, 128)]


def _ids(engine: LLMEngine, rng: random.Random, n: int) -> list[int]:
    top = min(10000, engine.model_config.vocab_size - 1)
    return [rng.randint(0, top) for _ in range(n)]


def prefill_tokens_per_s(engine: LLMEngine, prompt_len: int, n: int) -> float:
    """Gives prompt tokens computed per second while n prompts prefill (one output token each)."""
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    before = engine.get_stats().prompt_tokens
    for i in range(n):
        engine.add_request(f"p{i}", _ids(engine, rng, prompt_len), params)
    sync()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    sync()
    return (engine.get_stats().prompt_tokens - before) / (time.perf_counter() - t0)


def decode_step_s(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    """Gives the seconds of one decode step with `batch` sequences of about `context` tokens."""
    rng = random.Random(batch * 7919 + context)
    params = SamplingParams(max_tokens=steps + 512, ignore_eos=True)
    ids = [f"d{batch}-{context}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, _ids(engine, rng, context), params)
    pure = 0
    for _ in range(10_000):  # prefill (chunked, mixed with early decodes) until pure decode
        before = engine.get_stats().generation_tokens
        engine.step()
        pure = pure + 1 if engine.get_stats().generation_tokens - before == batch else 0
        if pure == 2:
            break
    sync()
    made = engine.get_stats().generation_tokens
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    elapsed = time.perf_counter() - t0
    produced = engine.get_stats().generation_tokens - made
    if produced != batch * steps:
        raise RuntimeError(f"batch {batch} x {steps} steps produced {produced} tokens: "
                           "not pure decode steps (preemption or unfinished prefill)")
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / steps


def fit(points: list[dict[str, float]]) -> tuple[float, float, float]:
    """Gives (base, per_seq, per_kv_token) of step = base + a·batch + b·batch·context."""
    x = np.array([[1.0, p["batch"], p["batch"] * p["context"]] for p in points])
    y = np.array([p["step_s"] for p in points])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return float(coef[0]), float(coef[1]), float(coef[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--smoke", action="store_true", help="tiny-llama on CPU, small grid")
    args = parser.parse_args()
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            engine_args = EngineArgs(model="tiny-llama", max_model_len=2048, max_num_seqs=16,
                                     num_kv_blocks=512, enable_prefix_caching=False)
            grid, prompt, steps = SMOKE_GRID, 128, 4
        else:
            fast_dummy_weights()
            path = model_dir(Path(tmp), "llama3-8b", LLAMA3_8B)
            engine_args = EngineArgs(model=str(path), load_format="dummy", max_model_len=4096,
                                     max_num_seqs=256, max_num_batched_tokens=8192,
                                     enable_prefix_caching=False)
            grid, prompt, steps = GRID, 1024, 32
        t0 = time.perf_counter()
        engine = LLMEngine.from_engine_args(engine_args)
        startup_s = time.perf_counter() - t0
        decode_step_s(engine, 1, 64, 4)  # warm-up (graphs, allocator)
        prefill = prefill_tokens_per_s(engine, prompt, 8 if args.smoke else 64)
        points = [{"batch": b, "context": c, "step_s": decode_step_s(engine, b, c, steps)}
                  for b, c in grid]
        base, per_seq, per_kv = fit(points)
        kv_tokens = engine.runner.num_blocks * engine_args.block_size
    result = {"gpu": card, "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "model": "smoke tiny-llama" if args.smoke else
              "Llama-3-8B shape, bf16, dummy weights",
              "engine_startup_s": startup_s, "prefill_tokens_per_s": prefill,
              "prefill_prompt_len": prompt, "decode_points": points,
              "decode_fit": {"base_s": base, "per_seq_s": per_seq, "per_kv_token_s": per_kv},
              "kv_capacity_tokens": kv_tokens, "max_num_seqs": engine_args.max_num_seqs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "smoke" if args.smoke else card.split()[-1].lower().replace("-", "")
    (out / f"sim_engine_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(f"| {p['batch']} | {p['context']} | {p['step_s'] * 1000:.2f} |"
                     for p in points)
    (out / f"sim_engine_{tag}.md").write_text(
        f"# Engine cost model for the simulator ({card}, {result['date']})\n\n"
        f"{result['model']}. Prefill {prefill:.0f} tokens/s ({prompt}-token prompts); "
        f"KV capacity {kv_tokens} tokens; engine start-up {startup_s:.1f} s.\n\n"
        "| batch | context | decode step ms |\n|---|---|---|\n" + rows +
        f"\n\nFit: step = {base * 1000:.2f} ms + {per_seq * 1e6:.1f} µs·batch + "
        f"{per_kv * 1e9:.2f} ns·batch·context.\n"
        "Reproduce: `python bench/sim_engine_gpu.py --out bench/results`.\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
