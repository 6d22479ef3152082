"""Offline throughput on CPU: kvpilot vs HF transformers `generate`, same weights, same run.

64 requests with seeded random prompt (32-256) and output (32-256) lengths on a tiny
Llama. HF runs them one by one and as one left-padded batch; kvpilot runs them
through LLM.generate with continuous batching. Prints output tokens/s, the two
speed ratios, and the KV slots allocated vs used (waste %) averaged over steps.

    .venv/bin/python bench/offline_throughput.py [--requests 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def write_model(root: Path) -> Path:
    """Gives a dir holding the tiny-llama built-in config saved as an HF checkpoint."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from kvpilot.engine.contracts.builtin_models import (
        BUILTIN_CONFIGS,
        TOKENIZER_CONFIG_FILE,
        TOKENIZER_FILE,
    )

    hf = {k: v for k, v in BUILTIN_CONFIGS["tiny-llama"].items()
          if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**hf)).float()
    path = root / "tiny-llama"
    model.save_pretrained(path, safe_serialization=True)
    shutil.copy(TOKENIZER_FILE, path / "tokenizer.json")
    shutil.copy(TOKENIZER_CONFIG_FILE, path / "tokenizer_config.json")
    return path


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    """Gives n (prompt token ids, output length) pairs, seeded."""
    rng = random.Random(seed)
    return [([rng.randrange(5, 1000) for _ in range(rng.randint(32, 256))], rng.randint(32, 256))
            for _ in range(n)]


def run_hf_sequential(model, work) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for prompt, out_len in work:
            ids = torch.tensor([prompt])
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                           min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def run_hf_padded(model, work) -> float:
    width = max(len(p) for p, _ in work)
    ids = torch.zeros(len(work), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, _) in enumerate(work):
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    longest = max(n for _, n in work)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def run_kvpilot(path: Path, work) -> tuple[float, float, int]:
    """Gives (seconds, KV waste fraction averaged over steps, preemptions)."""
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.entrypoints.llm import LLM

    llm = LLM(str(path), max_model_len=1024)
    engine = llm.engine
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(work):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=out_len,
                                                          ignore_eos=True))
    allocated = used = 0
    while engine.has_unfinished_requests():
        engine.step()
        kv = engine.kv
        allocated += (kv.num_blocks - kv.pool.num_free_blocks) * kv.block_size
        used += sum(s.num_computed_tokens for s in engine.scheduler.running)
    seconds = time.perf_counter() - start
    return seconds, 1 - used / max(allocated, 1), engine.get_stats().num_preemptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both engines (0: torch default)")
    parser.add_argument("--skip-sequential", action="store_true")
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating runs of kvpilot and HF padded; medians are reported")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    work = workload(args.requests, args.seed)
    out_tokens = sum(n for _, n in work)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        kv_runs, padded_runs = [], []
        for _ in range(args.repeats):  # alternate, so load changes hit both alike
            kv_s, waste, preemptions = run_kvpilot(path, work)
            kv_runs.append(kv_s)
            padded_runs.append(run_hf_padded(hf, work))
        kv_s, padded_s = statistics.median(kv_runs), statistics.median(padded_runs)
        seq_s = float("nan") if args.skip_sequential else run_hf_sequential(hf, work)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores shared with other jobs "
                   f"(load average {os.getloadavg()[0]:.1f} at the end), "
                   f"torch threads {torch.get_num_threads()}",
        "model": "tiny-llama (2 layers, hidden 128, vocab 1024), fp32",
        "requests": args.requests,
        "output_tokens": out_tokens,
        "kvpilot_tok_s": out_tokens / kv_s,
        "hf_padded_tok_s": out_tokens / padded_s,
        "hf_sequential_tok_s": out_tokens / seq_s,
        "speedup_vs_padded": padded_s / kv_s,
        "speedup_vs_sequential": seq_s / kv_s,
        "kv_waste_pct": 100 * waste,
        "preemptions": preemptions,
        "seconds": {"kvpilot": kv_s, "hf_padded": padded_s, "hf_sequential": seq_s},
        "runs": {"kvpilot": kv_runs, "hf_padded": padded_runs},
    }
    print(json.dumps(result, indent=2))
    write_results(result)


def write_results(result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"offline_throughput-cpu-{result['date']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    table = [
        f"# Offline throughput, CPU ({result['date']})",
        "",
        f"Machine: {result['machine']}. Model: {result['model']}. "
        f"{result['requests']} requests, prompts 32-256, outputs 32-256 tokens (seeded), "
        f"{result['output_tokens']} output tokens. Medians of {len(result['runs']['kvpilot'])} "
        "alternating runs (HF sequential: one run).",
        "",
        "| engine | output tokens/s | kvpilot speed-up |",
        "|---|---|---|",
        f"| kvpilot (continuous batching) | {result['kvpilot_tok_s']:.0f} | 1.00x |",
        f"| HF generate, one padded batch | {result['hf_padded_tok_s']:.0f} | "
        f"{result['speedup_vs_padded']:.2f}x |",
        f"| HF generate, sequential | {result['hf_sequential_tok_s']:.0f} | "
        f"{result['speedup_vs_sequential']:.2f}x |",
        "",
        f"KV slots allocated vs used: waste {result['kv_waste_pct']:.2f}% (step average); "
        f"preemptions {result['preemptions']}.",
        "",
        "Reproduce: `.venv/bin/python bench/offline_throughput.py`",
    ]
    stem.with_suffix(".md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
