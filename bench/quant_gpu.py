"""Issue 23 (quantization part) on one GPU: 8-bit weights and the fp8 KV cache, dummy weights.

a) batch-1 decode of a Llama-3-8B-shaped model: ms per output token with bf16, fp8 (W8A8,
   torch._scaled_mm) and int8 (W8A16, torch path) projection weights (goal: 8-bit >= 1.6x
   faster than bf16);
b) the nano-vllm recipe (bench/e2e_gpu.py c: Qwen3-0.6B shape, 256 requests, in/out
   100..1024, temperature 0.6): output tokens/s, bf16 vs fp8 weights + fp8 KV cache;
c) the most 4k-token sequences running at once (Qwen3-0.6B shape, 4000-token prompts and
   96 new tokens), bf16 KV vs fp8 KV at the same memory utilisation (goal 2x): the pool's
   capacity in 4096-token sequences and the peak of running sequences measured.

Every configuration runs in a fresh process. Writes results.json and results.md.

    python bench/quant_gpu.py OUT_DIR [--parts a,b,c]
    python bench/quant_gpu.py OUT_DIR --smoke     # CPU, tiny shapes, fp32; fp8 weights
                                                  # skipped (refused on CPU)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_smoke import one_thread_per_process
from e2e_gpu import QWEN3_0_6B, model_dir, recipe
from fresh_process import ChildFailed, call_in_fresh_process
from parallel_gpu import LLAMA3_8B, TINY

SEQ_TOKENS, SEQ_PROMPT = 4096, 4000
# part -> [(label, quantization, kv_cache_dtype)]
CONFIGS = {
    "a": [("bf16", "none", "auto"), ("fp8", "fp8", "auto"), ("int8", "int8", "auto")],
    "b": [("bf16", "none", "auto"), ("fp8+fp8kv", "fp8", "fp8")],
    "c": [("bf16kv", "none", "auto"), ("fp8kv", "none", "fp8")],
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_for(part: str, quantization: str, kv: str, smoke: bool, root: Path):
    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

    shape = TINY if smoke else (LLAMA3_8B if part == "a" else QWEN3_0_6B)
    max_len = 1024 if part == "a" else SEQ_TOKENS + 64 if part == "c" else 4096
    return LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir(root, "model", shape)), load_format="dummy",
        device="cpu" if smoke else "cuda", dtype="float32" if smoke else "bfloat16",
        quantization=quantization, kv_cache_dtype=kv, max_model_len=max_len,
        max_num_seqs=4 if part == "a" else 512, max_num_batched_tokens=16384,
        kv_cache_memory="1MiB" if smoke else None, gpu_memory_utilization=0.9))


def drain(engine, limit: int = 100_000) -> int:
    """Steps until every request is done; gives the peak of running sequences."""
    peak = 0
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return peak
        engine.step()
        peak = max(peak, engine.get_stats().num_running)
    raise RuntimeError(f"requests still unfinished after {limit} steps")


def run_config(part: str, quantization: str, kv: str, smoke: bool) -> dict:
    """Gives one configuration's numbers (in its own process)."""
    from kvpilot.engine.contracts.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        engine = engine_for(part, quantization, kv, smoke, Path(root))
        startup_s = time.perf_counter() - started
        runner = engine.runner
        out = {"startup_s": startup_s, "weight_bytes": runner.load_report().weight_bytes,
               "num_kv_blocks": runner.num_blocks, "block_size": runner.block_size}
        rng = random.Random(0)
        vocab = 1000 if smoke else 10000
        if part == "a":
            new = 8 if smoke else 128
            greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=new)
            for run in ("warm-up", "timed"):
                engine.add_request(run, [rng.randrange(vocab) for _ in range(128)], greedy)
                engine.step()  # the prefill and the first token
                sync()
                t0 = time.perf_counter()
                drain(engine)
                sync()
                out["batch1_ms_per_token"] = (time.perf_counter() - t0) / (new - 1) * 1e3
        elif part == "b":
            prompts, lens = recipe(8 if smoke else 256)
            if smoke:  # the tiny vocabulary, short
                prompts = [[t % vocab for t in p[:48]] for p in prompts]
                lens = [min(n, 16) for n in lens]
            engine.add_request("warm-up", [1, 2, 3], SamplingParams(max_tokens=8))
            drain(engine)
            for i, (prompt, n) in enumerate(zip(prompts, lens, strict=True)):
                engine.add_request(str(i), prompt, SamplingParams(
                    temperature=0.6, ignore_eos=True, max_tokens=n))
            sync()
            t0 = time.perf_counter()
            drain(engine)
            sync()
            out["output_tok_per_s"] = sum(lens) / (time.perf_counter() - t0)
        else:
            prompt_len, new = (60, 4) if smoke else (SEQ_PROMPT, SEQ_TOKENS - SEQ_PROMPT)
            capacity = runner.num_blocks // -(-(prompt_len + new) // runner.block_size)
            out["capacity_seqs"] = capacity
            for i in range(min(2 * capacity + 8, 512)):
                engine.add_request(str(i), [rng.randrange(vocab) for _ in range(prompt_len)],
                                   SamplingParams(temperature=0, ignore_eos=True, max_tokens=new))
            out["peak_running_seqs"] = drain(engine)
            out["preemptions"] = engine.get_stats().num_preemptions
        stats = engine.get_stats()
        out |= {"graph_steps": stats.graph_steps, "eager_steps": stats.eager_steps}
        engine.shutdown()
    return out


def in_fresh_process(part: str, label: str, quantization: str, kv: str, smoke: bool) -> dict:
    try:
        numbers = call_in_fresh_process(run_config, part, quantization, kv, smoke,
                                        reuse_imports=smoke, timeout=600)
    except ChildFailed as exc:
        return {"part": part, "label": label, "error": str(exc)[-3000:]}
    return {"part": part, "label": label, "quantization": quantization, "kv_cache_dtype": kv,
            **numbers}


def markdown(report: dict) -> str:
    rows = report["configs"]
    base = {r["part"]: r for r in rows if r["label"] in ("bf16", "bf16kv") and "error" not in r}
    out = [f"# 8-bit weights and fp8 KV ({report['machine']}, {report['date']})", "",
           f"Command: `{report['command']}`", "",
           "| part | config | metric | value | vs bf16 | weight GB | KV blocks | graph steps |",
           "|---|---|---|---|---|---|---|---|"]
    metric = {"a": ("batch1_ms_per_token", True), "b": ("output_tok_per_s", False),
              "c": ("capacity_seqs", False)}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['part']} | {r['label']} | failed | see results.json | | | | |")
            continue
        key, lower_better = metric[r["part"]]
        ref = base.get(r["part"])
        ratio = "-" if ref is None else (
            f"{ref[key] / r[key]:.2f}x" if lower_better else f"{r[key] / ref[key]:.2f}x")
        value = f"{r[key]:.2f}" + (f" (peak running {r['peak_running_seqs']})"
                                   if r["part"] == "c" else "")
        out.append(f"| {r['part']} | {r['label']} | {key} | {value} | {ratio} "
                   f"| {r['weight_bytes'] / 1e9:.2f} | {r['num_kv_blocks']} | {r['graph_steps']} |")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--parts", default="a,b,c")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    args = parser.parse_args()
    if args.smoke:
        one_thread_per_process()
    report = {"machine": "CPU smoke run" if args.smoke else torch.cuda.get_device_name(0),
              "date": datetime.date.today().isoformat(), "host": platform.node(),
              "torch": torch.__version__,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "configs": []}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for part in args.parts.split(","):
        for label, quantization, kv in CONFIGS[part]:
            if args.smoke and quantization == "fp8":  # refused on CPU: no FP8 tensor cores
                continue
            report["configs"].append(in_fresh_process(part, label, quantization, kv,
                                                      args.smoke))
            (args.out_dir / "results.json").write_text(json.dumps(report, indent=2))
            (args.out_dir / "results.md").write_text(markdown(report))
            print(f"done: {part} {label}", flush=True)
    print(markdown(report))
    return 1 if any("error" in r for r in report["configs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
