"""Where a host-bound decode step's time goes: the Qwen3-0.6B shape at batch 64 (dummy
weights, graphs, async scheduling), as `bench/lora_gpu.py`'s base mode runs it, under
cProfile.

On the lent hosts this step moves 1.55-2.63 ms from engine process to engine process while
the GPU needs ~1.5 ms (issue 44's LoRA and json_schema ratios inherit that), and the
engine's phases add up to the step: the host is the bound. Per run (each a fresh process):
the median decode step without the profiler, the engine's phases (median ms of the timed
steps), then the same loop under cProfile: the functions with the most own time and the
most cumulative time.

    python3 bench/step_host_profile_gpu.py [--runs 2] [--steps 200]
    python3 bench/step_host_profile_gpu.py --smoke     # CPU, tiny-llama: checks the script
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import shutil
import statistics
import tempfile
from pathlib import Path

from closed_loop import closed_loop
from fresh_process import call_in_fresh_process


def run(model: str, smoke: bool, steps: int) -> dict:
    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

    batch = 4 if smoke else 64
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, load_format="dummy", device="cpu" if smoke else "cuda",
        max_model_len=1024, dtype="float32" if smoke else "bfloat16", max_num_seqs=batch,
        kv_cache_memory="64MiB" if smoke else None, gpu_memory_utilization=0.85))
    vocab = engine.model_config.vocab_size
    rng = random.Random(1)
    params = SamplingParams(temperature=1.0, max_tokens=256, ignore_eos=True)
    ids = iter(range(10**9))

    def add() -> None:
        engine.add_request(f"r{next(ids)}", [rng.randrange(vocab - 3) for _ in range(32)],
                           params)

    phases: dict[str, list[float]] = {}
    step = engine.step

    def recorded() -> list:
        out = step()
        for name, seconds in engine.flights.phases.items():
            phases.setdefault(name, []).append(seconds * 1e3)
        return out

    engine.step = recorded  # type: ignore[method-assign]
    plain = closed_loop(engine, batch, 30, steps, add)
    profiler = cProfile.Profile()
    profiler.enable()
    profiled = closed_loop(engine, batch, 0, steps, add)
    profiler.disable()
    engine.shutdown()
    tables = {}
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(25)
        tables[key] = text.getvalue()
    return {"decode_step_ms_median": statistics.median(plain.decode_step_ms or [0.0]),
            "profiled_step_ms_median": statistics.median(profiled.decode_step_ms or [0.0]),
            "phases_ms_median": {k: round(statistics.median(v), 3) for k, v in phases.items()},
            "top_own_time": tables["tottime"], "top_cumulative": tables["cumulative"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="kvpilot-step-profile-"))
    try:
        if args.smoke:
            model = "tiny-llama"
        else:
            from structured_gpu import model_dir
            model = str(model_dir(scratch))
        for i in range(args.runs):
            row = call_in_fresh_process(run, model, args.smoke, args.steps,
                                        reuse_imports=args.smoke)
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("top")}))
            print(row["top_own_time"])
            print(row["top_cumulative"])
            print(f"== run {i} done", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
