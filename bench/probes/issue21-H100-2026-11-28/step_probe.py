"""Probe: the recipe's steps, host vs GPU. Runs the recipe twice in one process (the second
timed), recording per engine.step(): wall, the host's wait for the GPU, the batch size and
whether it ran eagerly; then times each decode graph bucket's replay alone."""
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, "bench")
import torch  # noqa: E402
from e2e_gpu import fast_dummy_weights, model_dir, recipe, sync  # noqa: E402
from shapes import QWEN3_0_6B  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kvpilot.engine.contracts.sampling_params import SamplingParams  # noqa: E402
from kvpilot.engine.llm import LLM  # noqa: E402


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    fast_dummy_weights()
    prompts, lens = recipe(256, seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(Path(tmp), "qwen3-0.6b-shape", QWEN3_0_6B)
        llm = LLM(str(path), load_format="dummy", max_model_len=4096, max_num_seqs=256,
                  max_num_batched_tokens=16384)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in lens]
        engine = llm.engine
        records = []
        real_step = engine.step

        def step():
            t0 = time.perf_counter()
            res = real_step()
            plan = engine._last_plan
            records.append((t0, time.perf_counter(), engine._gpu_wait_s,
                            len(plan.scheduled) if plan is not None else 0,
                            engine._last_eager, dict(engine._phases)))
            return res

        for run in ("untimed", "timed"):
            records.clear()
            engine.step = step
            sync()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            sync()
            wall = time.perf_counter() - t0
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"{run}: {wall:.3f} s, {toks / wall:.0f} tok/s", flush=True)
        runner = engine.runner
        graphs = runner.decode_graphs
        replay = {}
        for size, g in sorted(graphs.graphs.items()):
            replay[size] = do_bench(g.replay, warmup=5, rep=30, return_mode="median")
        print("replay ms by bucket:", {k: round(v, 3) for k, v in replay.items()})
    # summarise by batch region
    regions = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    eager = [0, 0.0]
    phase_tot = defaultdict(float)
    gaps = [b[0] - a[1] for a, b in zip(records, records[1:])] + [0.0]
    for (t0, t1, wait, n, was_eager, phases), gap in zip(records, gaps):
        if was_eager:
            eager[0] += 1
            eager[1] += t1 - t0
            continue
        key = min((b for b in (8, 16, 32, 64, 128, 192, 256) if b >= n), default=256)
        r = regions[key]
        r[0] += 1
        r[1] += t1 - t0
        r[2] += wait
        r[3] += gap
        for k, v in phases.items():
            phase_tot[k] += v
    lines = [f"seed {seed}; wall of the timed run above; eager steps {eager[0]}: {eager[1]:.3f} s"]
    lines.append("| rows up to | steps | step ms | GPU-wait ms | host ms (step - wait) | "
                 "outside step ms | region s |")
    for key in sorted(regions):
        c, s, w, g = regions[key]
        lines.append(f"| {key} | {c} | {s / c * 1e3:.3f} | {w / c * 1e3:.3f} | "
                     f"{(s - w) / c * 1e3:.3f} | {g / c * 1e3:.3f} | {s + g:.3f} |")
    lines.append("phases summed over graph steps (s): " +
                 ", ".join(f"{k} {v:.3f}" for k, v in phase_tot.items()))
    print("\n".join(lines))
    json.dump({"records": [r[:5] for r in records], "replay_ms": replay},
              open(out / f"steps-seed{seed}.json", "w"))


if __name__ == "__main__":
    main()
