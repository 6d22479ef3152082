"""Issue 24: throughput of a batch spread over 8 LoRA adapters vs the base model alone
(goal: lora8 >= 0.8x base), in one call.

A dummy model (bf16, random weights), Qwen3-0.6B-shaped by default (the synthetic tokenizer
of bench/structured_gpu.py) or Llama-3-8B-shaped (`--shape 8b`, bench/parallel_gpu.py's), and
8 random PEFT adapters of rank 16 on all seven projections, written to a scratch folder that
is removed at the end. The smaller the model, the larger LoRA's share of a step: at 0.6B a
decode step is ~2.3 ms for 28 layers, and LoRA's 8 small kernels per layer weigh on it. A closed loop keeps `batch` requests in flight (a finished one is replaced
at once) for a fixed number of steps, in three modes, each its own engine process:

- `base`: no --enable-lora, every request on the base model;
- `lora_base`: --enable-lora --max-loras 8, every request on the base model (the hooks' cost);
- `lora8`: --enable-lora --max-loras 8, requests spread round-robin over the 8 adapters.

Reported per mode: output tokens/s over the timed steps and the median ms of pure decode
steps with the whole batch running (`closed_loop.py`: the wall time of `step()`, no device
sync between steps). `ratio` = lora8 / base tokens/s.

    python bench/lora_gpu.py OUT_DIR [--shape 8b]   # CUDA
    python bench/lora_gpu.py OUT_DIR --smoke    # CPU, tiny-llama, a few steps
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from closed_loop import closed_loop
from cpu_smoke import one_thread_per_process
from fresh_process import call_in_fresh_process

MODES = ("base", "lora_base", "lora8")
NUM_ADAPTERS = 8
RANK = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    """Gives projection -> (in, out) of one decoder layer of `config`."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def write_adapters(config: dict, root: Path, count: int, rank: int) -> list[str]:
    """Gives `name=path` of `count` random PEFT adapters (rank `rank`, all projections)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    shapes = _shapes(config)
    modules = []
    for i in range(count):
        path = root / f"adapter{i}"
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(PROJECTIONS), "bias": "none"}))
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for proj, (fan_in, fan_out) in shapes.items():
                owner = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{owner}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
        save_file(tensors, str(path / "adapter_model.safetensors"))
        modules.append(f"adapter{i}={path}")
    return modules


def run_mode(model: str, mode: str, modules: list[str], smoke: bool) -> dict:
    """Gives one mode's numbers: a closed loop of `batch` requests for the timed steps."""
    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

    device = "cpu" if smoke else "cuda"
    batch, warm_steps, timed_steps = (4, 3, 12) if smoke else (64, 30, 300)
    lora = mode != "base"
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, load_format="dummy", device=device, max_model_len=1024,
        dtype="float32" if smoke else "bfloat16", max_num_seqs=batch,
        kv_cache_memory="64MiB" if smoke else None, gpu_memory_utilization=0.85,
        enable_lora=lora, lora_modules=modules if lora else None,
        max_loras=NUM_ADAPTERS, max_lora_rank=RANK))
    vocab = engine.model_config.vocab_size
    rng = random.Random(1)
    params = SamplingParams(temperature=1.0, max_tokens=128 if smoke else 256, ignore_eos=True)
    names = [m.split("=", 1)[0] for m in modules] if mode == "lora8" else [None]
    ids = iter(range(10**9))

    def add_request() -> None:
        n = next(ids)
        engine.add_request(f"r{n}", [rng.randrange(vocab - 3) for _ in range(32)], params,
                           lora_name=names[n % len(names)])

    loop = closed_loop(engine, batch, warm_steps, timed_steps, add_request)
    step_ms = loop.decode_step_ms
    stats = engine.get_stats()
    running = sorted({s.request.lora_name or "base" for s in engine.scheduler.running})
    engine.shutdown()
    return {"mode": mode, "device": device, "batch": batch, "timed_steps": timed_steps,
            "decode_step_ms_median": statistics.median(step_ms) if step_ms else None,
            "pure_decode_steps": len(step_ms), "output_tok_per_s": loop.tok_per_s,
            "graph_steps": stats.graph_steps, "eager_steps": stats.eager_steps,
            "adapters_running_at_end": running}


def main() -> int:
    parser = argparse.ArgumentParser(description="Issue 24: 8 LoRA adapters vs the base model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny-llama, a few steps")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--shape", choices=("0.6b", "8b"), default="0.6b",
                        help="the base model's shape (CUDA; the smoke runs tiny-llama)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kvpilot-lora-bench-"))  # GBs at 8B: not in out
    try:
        if args.smoke:
            one_thread_per_process()
            from kvpilot.engine.contracts.builtin_models import BUILTIN_CONFIGS

            model, config = "tiny-llama", BUILTIN_CONFIGS["tiny-llama"]
        elif args.shape == "8b":
            import parallel_gpu  # the same folder: bench/

            model, config = str(parallel_gpu.model_dir(scratch, "8b")), parallel_gpu.LLAMA3_8B
        else:
            from structured_gpu import QWEN3_0_6B, model_dir

            model, config = str(model_dir(scratch)), QWEN3_0_6B
        modules = write_adapters(config, scratch / "adapters", NUM_ADAPTERS, RANK)
        rows = []
        for mode in args.modes.split(","):  # each engine in its own process: the last freed
            rows.append(call_in_fresh_process(run_mode, model, mode, modules, args.smoke,
                                              reuse_imports=args.smoke))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    by_mode = {r["mode"]: r for r in rows}
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "host": platform.node(), "gpu": torch.cuda.get_device_name()
              if torch.cuda.is_available() else None, "smoke": args.smoke,
              "shape": "tiny-llama" if args.smoke else args.shape, "adapters": NUM_ADAPTERS, "rank": RANK, "rows": rows}
    base, lora8 = by_mode.get("base"), by_mode.get("lora8")
    if base and lora8:
        result["ratio_tok_per_s"] = lora8["output_tok_per_s"] / base["output_tok_per_s"]
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    lines = [f"{result['shape']} shape, {NUM_ADAPTERS} adapters of rank {RANK}\n",
             "| mode | output tok/s | decode step ms (median) | graph / eager steps |",
             "|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['output_tok_per_s']:.0f} | {r['decode_step_ms_median']} | "
              f"{r['graph_steps']} / {r['eager_steps']} |" for r in rows]
    lines.append(f"\nratio (lora8 / base, output tok/s): {result.get('ratio_tok_per_s')} "
                 "(goal: >= 0.8)")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
