"""Where the nano-vllm recipe's time goes (issue 21's 20k tok/s line).

Runs bench/e2e_gpu.py's c) once plainly (the wall clock to compare), then once more under
torch.profiler (CUDA kernels only) and reports: the GPU's busy and idle seconds over the
run, the kernels taking the most total time, and the time per kernel family (attention,
GEMM, norm, sampling, ...). A busy GPU with a big family says which kernel to speed up; a
large idle share says the host or the launches are the bound.

    python bench/recipe_profile_gpu.py OUT [--requests 256] [--seed 0]
    python bench/recipe_profile_gpu.py /tmp/out --smoke     # CPU, a tiny model: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from e2e_gpu import DEVICE, fast_dummy_weights, model_dir, recipe, sync
from shapes import QWEN3_0_6B
from step_profile_gpu import busy_ms

# kernel-name fragments per family, first match wins (names from H100 traces of the engine)
FAMILIES = (
    ("decode attention", ("_decode_split", "_decode_merge")),
    ("prefill attention", ("_prefill_kernel",)),
    ("GEMM", ("nvjet", "gemm", "cutlass", "sm90_xmma", "gemv", "w8a16")),
    ("norm", ("rmsnorm",)),
    ("rotary / KV write", ("rotary", "rope", "kv_cache_write", "reshape_and_cache")),
    ("activation", ("silu", "act_and_mul", "activation")),
    ("sampling (softmax, noise, argmax)", ("softmax", "exponential", "argmax", "max_", "reduce",
                                           "div", "distribution")),
)


def family(name: str, families: tuple = FAMILIES) -> str:
    lowered = name.lower()
    return next((fam for fam, parts in families if any(p in lowered for p in parts)), "other")


def run(path: Path, prompts, out_lens, profiled: bool, smoke: bool) -> tuple[dict, list]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.entrypoints.llm import LLM

    llm = LLM(str(path), load_format="dummy", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=16384,
              **({"device": "cpu", "dtype": "float32", "kv_cache_memory": "64MiB"}
                 if smoke else {}))
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    cuda = DEVICE == "cuda"
    prof = torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
    sync()
    started = time.perf_counter()
    with prof if profiled else contextlib.nullcontext():
        outputs = llm.generate(prompts, params)
        sync()
    elapsed = time.perf_counter() - started
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind] if profiled else []
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    del llm
    return {"elapsed_s": round(elapsed, 3), "output_tokens": produced,
            "output_tok_per_s": round(produced / elapsed, 1)}, events


def summarise(events: list, wall_s: float) -> dict:
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        by_name[e.name].append(e.time_range.end - e.time_range.start)
    by_family: dict[str, float] = defaultdict(float)
    for name, times in by_name.items():
        by_family[family(name)] += sum(times) / 1e6
    busy_s = busy_ms([(e.time_range.start, e.time_range.end) for e in events]) / 1e3
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    return {"gpu_busy_s": round(busy_s, 3), "gpu_idle_s": round(wall_s - busy_s, 3),
            "kernels": len(events),
            "families_s": {k: round(v, 3) for k, v in sorted(by_family.items(),
                                                              key=lambda kv: -kv[1])},
            "top": [{"name": name[:100], "count": len(t), "us_mean": round(sum(t) / len(t), 2),
                     "total_s": round(sum(t) / 1e6, 3)} for name, t in top]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 4 requests")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fast_dummy_weights()
    config = QWEN3_0_6B
    if args.smoke:
        config = {**QWEN3_0_6B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16}
    prompts, out_lens = recipe(4 if args.smoke else args.requests, args.seed)
    if args.smoke:
        prompts, out_lens = [[t % 512 for t in p[:20]] for p in prompts], [8] * len(prompts)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(Path(tmp), "qwen3-0.6b-shape", config)
        plain, _ = run(path, prompts, out_lens, profiled=False, smoke=args.smoke)
        print("plain:", plain, flush=True)
        profiled, events = run(path, prompts, out_lens, profiled=True, smoke=args.smoke)
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
              "torch": torch.__version__, "seed": args.seed, "plain": plain,
              "profiled": profiled | summarise(events, profiled["elapsed_s"])}
    (args.out / f"recipe_profile-seed{args.seed}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["profiled"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
