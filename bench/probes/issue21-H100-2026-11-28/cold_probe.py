"""Probe: why a fresh process's first recipe run is slower than its second (warm disk cache).

Runs the recipe twice in one process after the usual 8-token warm-up, both timed, recording
per engine.step() its wall time, rows and eagerness, and every Triton compile (or disk-cache
load) and autotune with the step it happened in. Prints the steps that lost most in run 1.
"""
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "bench")
from e2e_gpu import fast_dummy_weights, model_dir, recipe, sync  # noqa: E402
from shapes import QWEN3_0_6B  # noqa: E402
from triton.runtime import autotuner, jit  # noqa: E402

from kvpilot.engine.contracts.sampling_params import SamplingParams  # noqa: E402
from kvpilot.engine.llm import LLM  # noqa: E402

STEP = [-1, "startup"]
EVENTS = []

real_compile = jit.JITFunction._do_compile


def logged_compile(self, *args, **kwargs):
    t0 = time.perf_counter()
    out = real_compile(self, *args, **kwargs)
    EVENTS.append((STEP[1], STEP[0], "compile", getattr(self, "__name__", "?"),
                   (time.perf_counter() - t0) * 1e3))
    return out


jit.JITFunction._do_compile = logged_compile
real_tune = autotuner.Autotuner.run


def logged_tune(self, *args, **kwargs):
    before = len(self.cache)
    t0 = time.perf_counter()
    out = real_tune(self, *args, **kwargs)
    if len(self.cache) != before:
        EVENTS.append((STEP[1], STEP[0], "autotune", getattr(self.fn, "__name__", "?"),
                       (time.perf_counter() - t0) * 1e3))
    return out


autotuner.Autotuner.run = logged_tune
GC = []
_gc_t = [0.0]


def on_gc(phase, info):
    if phase == "start":
        _gc_t[0] = time.perf_counter()
    else:
        GC.append((STEP[1], STEP[0], info["generation"], (time.perf_counter() - _gc_t[0]) * 1e3))


gc.callbacks.append(on_gc)


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    fast_dummy_weights()
    prompts, lens = recipe(256, seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(Path(tmp), "qwen3-0.6b-shape", QWEN3_0_6B)
        t0 = time.perf_counter()
        llm = LLM(str(path), load_format="dummy", max_model_len=4096, max_num_seqs=256,
                  max_num_batched_tokens=16384)
        print(f"startup {time.perf_counter() - t0:.2f} s", flush=True)
        STEP[1] = "warm-up"
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in lens]
        engine = llm.engine
        import torch
        graphs = engine.runner.decode_graphs
        for size in (256, 240, 176, 112, 56, 8):
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graphs.graphs[size].replay()
                torch.cuda.synchronize()
                times.append(round((time.perf_counter() - t0) * 1e3, 2))
            print(f"bucket {size} replays ms: {times}", flush=True)
        real_step = engine.step
        runs = {}

        def step():
            STEP[0] += 1
            t0 = time.perf_counter()
            res = real_step()
            plan = engine._last_plan
            runs[STEP[1]].append((time.perf_counter() - t0,
                                  len(plan.scheduled) if plan is not None else 0,
                                  engine._last_eager,
                                  sum(n for _, n in plan.scheduled) if plan is not None else 0,
                                  dict(engine._phases)))
            return res

        engine.step = step
        for run in ("run1", "run2"):
            STEP[:] = [-1, run]
            runs[run] = []
            sync()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            sync()
            wall = time.perf_counter() - t0
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"{run}: {wall:.3f} s, {toks / wall:.0f} tok/s, {len(runs[run])} steps",
                  flush=True)
    r1, r2 = runs["run1"], runs["run2"]
    print("steps aligned:", len(r1) == len(r2))
    diffs = sorted(((a[0] - b[0], i, a, b) for i, (a, b) in enumerate(zip(r1, r2))),
                   reverse=True)
    print("run1 - run2 summed over steps: %.3f s" % sum(d for d, *_ in diffs))
    for cut in (0.001, 0.003, 0.01):
        sel = [d for d, *_ in diffs if d > cut]
        print(f"steps losing > {cut * 1e3:.0f} ms: {len(sel)}, {sum(sel):.3f} s")
    print("top steps: index, run1 ms, run2 ms, rows, eager, tokens")
    for d, i, a, b in diffs[:30]:
        print(f"  {i:5d} {a[0] * 1e3:8.2f} {b[0] * 1e3:8.2f} rows {a[1]:4d} eager {a[2]} "
              f"tokens {a[3]}")
        print("      run1", {k: round(v * 1e3, 2) for k, v in a[4].items()})
        print("      run2", {k: round(v * 1e3, 2) for k, v in b[4].items()})
    for run in ("run1", "run2"):
        g = [x for x in GC if x[0] == run]
        print(run, "GC:", len(g), "collections", round(sum(x[3] for x in g), 1), "ms;",
              "gen2:", [(x[1], round(x[3], 1)) for x in g if x[2] == 2],
              "over 2 ms:", [(x[1], x[2], round(x[3], 1)) for x in g if x[3] > 2][:20])
    print("Triton events (phase, step, kind, kernel, ms):")
    tot = {}
    for ev in EVENTS:
        tot[ev[0]] = tot.get(ev[0], 0.0) + ev[4]
        if ev[0] != "startup":
            print("  ", ev[0], ev[1], ev[2], ev[3], f"{ev[4]:.1f}")
    print("Triton ms by phase:", {k: round(v) for k, v in tot.items()},
          "events", len(EVENTS), "CUDA_MODULE_LOADING", os.environ.get("CUDA_MODULE_LOADING"))


if __name__ == "__main__":
    main()
