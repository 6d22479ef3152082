"""The engine's host time per step without the model: scheduling, batch building, sampling, outputs.

Runs `LLMEngine` on CPU with the built-in tiny Qwen3 and the model call replaced
by a no-op: the forward gives zeros and the LM head gives fixed random logits,
so what is timed is the engine's own Python (and the sampler's small tensor ops
on a 1,024-token vocabulary). Cases: 256 concurrent decodes sampled at
temperature 0.6 (benchmark c's mix), 256 greedy decodes, and batch-1 greedy
decode (benchmark d). Prompts are 500-900 tokens so block tables are ~40-60
wide, as in c). Only steady-state decode steps are timed (all prefills done).

With `--baseline REV` the same cases also run against the engine at git
revision REV (extracted with `git archive` into a temporary dir and put first
on PYTHONPATH), alternating after/before in separate processes, medians of
`--repeats` runs: both columns come from one run on one machine.

    .venv/bin/python bench/host_overhead.py [--baseline REV] [--steps 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parent.parent
CASES = {  # name: (concurrent sequences, temperature, streaming outputs)
    "c_like_256_sampled_offline": (256, 0.6, False),  # LLM.generate, as benchmark c)
    "256_greedy_streaming": (256, 0.0, True),  # the server's mode
    "d_like_1_greedy_streaming": (1, 0.0, True),  # LLMEngine.step, as benchmark d)
}
# logits columns: the sampler's tensor ops over a real vocabulary run on the GPU in c)/d);
# on CPU they would swamp the Python being measured, so the fixed logits are this narrow
LOGITS_WIDTH = 64


def make_engine(num_seqs: int, stream_outputs: bool):
    """Gives a CPU engine whose model call is a no-op (zeros hidden, fixed random logits)."""
    import torch

    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model="tiny-qwen3", device="cpu", max_model_len=4096, max_num_seqs=max(num_seqs, 1),
        max_num_batched_tokens=16384, num_kv_blocks=num_seqs * 100 + 64))
    engine.stream_outputs = stream_outputs
    if hasattr(engine, "freeze_gc_heap"):
        engine.freeze_gc_heap()  # what from_engine_args does on CUDA (absent before 5918aac)
    runner = engine.runner
    hidden_size = runner.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    fixed = torch.randn(num_seqs, LOGITS_WIDTH, generator=gen)

    def forward(input_ids, positions, meta, kv_caches):
        return torch.zeros(input_ids.shape[0], hidden_size)

    def compute_logits(hidden):
        return fixed[:hidden.shape[0]]

    runner.forward = forward
    runner.model.compute_logits = compute_logits
    return engine


def measure(case: str, steps: int) -> dict:
    """Gives the median and mean host µs per decode step of `case`, and a phase split."""
    import torch

    from kvpilot.engine.contracts.sampling_params import SamplingParams

    num_seqs, temperature, stream_outputs = CASES[case]
    engine = make_engine(num_seqs, stream_outputs)
    rng = random.Random(0)
    # enough output that nobody finishes while timed; the no-op model makes prefill free
    split_steps = min(steps, 100)
    params = SamplingParams(temperature=temperature, ignore_eos=True,
                            max_tokens=steps + split_steps + 64)
    for i in range(num_seqs):
        prompt = [rng.randint(5, 1000) for _ in range(rng.randint(500, 900))]
        engine.add_request(f"r{i}", prompt, params)
    while any(s.num_computed_tokens == 0 or not s.is_decode
              for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(10):  # warm-up decode steps
        engine.step()
    phases = {"schedule": 0.0, "execute": 0.0, "sampler": 0.0}

    def timed(obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            phases[key] += time.perf_counter() - t0
            return out

        setattr(obj, name, wrapper)

    times = []
    with torch.inference_mode():
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        # the phase split runs separately so its wrappers do not inflate the totals above
        timed(engine.scheduler, "schedule", "schedule")
        timed(engine.runner, "execute", "execute")
        timed(engine, "sampler", "sampler")
        t0 = time.perf_counter()
        for _ in range(split_steps):
            engine.step()
        total = time.perf_counter() - t0
    phases["other"] = total - sum(phases.values())
    return {"case": case, "num_seqs": num_seqs, "temperature": temperature,
            "stream_outputs": stream_outputs, "steps": steps,
            "median_us": statistics.median(times) * 1e6, "mean_us": statistics.mean(times) * 1e6,
            "phase_us": {k: v / split_steps * 1e6 for k, v in phases.items()}}


def extract(rev: str, root: Path) -> Path:
    """Gives a PYTHONPATH dir holding the `kvpilot` package of git revision `rev`."""
    src = root / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "engine", "kernels",
                              "cli", "operator"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = root / "path" / "kvpilot"
    pkg.mkdir(parents=True)
    for name in ("engine", "kernels", "cli", "operator"):
        (pkg / name).symlink_to(src / name)
    return root / "path"


def run_child(case: str, steps: int, pythonpath: Path | None) -> dict:
    """Gives `measure(case)` run in a fresh process (optionally on another revision)."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    cmd = [sys.executable, __file__, "--child", case, "--steps", str(steps)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def engine_rev() -> str:
    """Gives the last commit touching engine/, with "+edits" when engine/ has uncommitted ones."""
    rev = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h", "--", "engine"],
                         check=True, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", "engine"],
                           check=False).returncode
    return rev + ("+edits" if dirty else "")


def rev_of(rev: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], check=True,
                          capture_output=True, text=True).stdout.strip()


def markdown(result: dict) -> str:
    base = result.get("baseline")
    head = ["case", f"after ({result['after']}) µs/step, median / mean"]
    if base:
        head += [f"before ({base}) µs/step, median / mean", "before / after (mean)"]
    head.append("after: schedule / execute / sampler / other µs")
    lines = [f"# Engine host time per decode step, no model ({result['machine']}, "
             f"{result['date']})", "",
             "CPU, 1 torch thread, tiny-qwen3, forward and LM head replaced by no-ops (fixed "
             f"logits {LOGITS_WIDTH} wide); prompts 500-900 tokens, block size 16. Medians of "
             f"{result['repeats']} alternating runs of {result['steps']} decode steps (the run "
             "with the middle median); the mean counts the GC pauses a median hides. "
             f"Load average at start {result['load']}. The phase split comes from a separate "
             "100-step pass with timers around each phase (later, longer sequences): it shows "
             "where time goes, not totals.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, row in result["cases"].items():
        after = row["after"]
        cells = [case, f"{after['median_us']:.0f} / {after['mean_us']:.0f}"]
        if base:
            before = row["before"]
            cells += [f"{before['median_us']:.0f} / {before['mean_us']:.0f}",
                      f"{before['mean_us'] / after['mean_us']:.2f}x"]
        p = after["phase_us"]
        cells.append(f"{p['schedule']:.0f} / {p['execute']:.0f} / {p['sampler']:.0f} / "
                     f"{p['other']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="git revision to compare against")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="results file stem (default: dated)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.steps)))
        return
    cases = args.cases.split(",")
    result = {"machine": f"{platform.machine()} {os.cpu_count()} cores (shared)",
              "date": datetime.date.today().isoformat(), "steps": args.steps,
              "repeats": args.repeats, "load": round(os.getloadavg()[0], 2),
              "after": f"engine at {engine_rev()}", "baseline": None, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        base_path = None
        if args.baseline:
            result["baseline"] = rev_of(args.baseline)
            base_path = extract(args.baseline, Path(tmp))
        for case in cases:
            runs: dict[str, list[dict]] = {"after": [], "before": []}
            for _ in range(args.repeats):
                runs["after"].append(run_child(case, args.steps, None))
                if base_path is not None:
                    runs["before"].append(run_child(case, args.steps, base_path))
            row = {}
            for side, rs in runs.items():
                if rs:
                    best = sorted(rs, key=lambda r: r["median_us"])[len(rs) // 2]
                    row[side] = {**best, "all_median_us": [r["median_us"] for r in rs]}
            result["cases"][case] = row
            print(case, {k: (round(v["median_us"]), round(v["mean_us"])) for k, v in row.items()},
                  flush=True)
    stem = args.out or f"host_overhead-cpu-{result['date']}"
    RESULTS.mkdir(exist_ok=True)
    assert not os.path.isabs(stem), "--out is a file stem under bench/results"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (RESULTS / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
