"""Issue 7 c) and d): the engine end to end on one GPU, dummy weights, no downloads.

c) the nano-vllm recipe: a Qwen3-0.6B-shaped model, 256 requests of random
   token ids, input and output lengths uniform in 100..1024, ignore_eos,
   temperature 0.6; output tokens/s of kvpilot, then of HF transformers
   `generate` (a padded static batch of the first --hf-requests requests:
   only each request's own tokens count as output) in the same run.
d) batch-1 decode of a Llama-3-8B-shaped model: ms per output token through
   the engine, and of one CUDA-graph replay alone, against the roofline
   weight bytes / device-to-device copy bandwidth measured in the same run.

    python bench/e2e_gpu.py --out bench/results [--only c|d]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch
from shapes import LLAMA3_8B, QWEN3_0_6B
from triton.testing import do_bench

# CPU only for a smoke run of the code paths; the numbers mean something on a GPU alone
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def model_dir(root: Path, name: str, config: dict) -> Path:
    """Gives a model dir with config.json and a word-level tokenizer covering the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def fast_dummy_weights() -> None:
    """Makes the loader draw dummy weights on the GPU: the CPU generator it uses by default
    (same values on any device) takes minutes for 8B parameters; the values do not matter."""
    from kvpilot.engine.models import loader

    def init_on_device(model: torch.nn.Module, seed: int) -> None:
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.data.fill_(1.0)
            else:
                param.data.normal_(0.0, loader.DUMMY_STD)

    loader.init_dummy_weights = init_on_device


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Gives device-to-device copy bandwidth in GB/s (bytes read plus written)."""
    src = torch.randn(num_bytes // 2, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * num_bytes / ms / 1e6


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def recipe(num_requests: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Gives the nano-vllm benchmark's prompts (random ids) and output lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
               for _ in range(num_requests)]
    return prompts, [rng.randint(100, 1024) for _ in range(num_requests)]


def time_phases(runner) -> dict[str, float]:
    """Wraps the runner's phases to add up their synchronised seconds: the whole model call
    (`execute`), building the batch, graph replays, eager forwards and the LM head. What
    `execute` leaves out is scheduling, sampling and output building."""
    totals: dict[str, float] = {}

    def wrap(obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            sync()  # the sampler syncs right after the step anyway
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - t0
            totals[key + "_calls"] = totals.get(key + "_calls", 0) + 1
            return out

        setattr(obj, name, timed)

    wrap(runner, "execute", "execute")
    wrap(runner, "build_batch", "build_batch")
    wrap(runner.model, "forward", "eager_forward")
    wrap(runner.model, "compute_logits", "lm_head")
    if runner.decode_graphs is not None:
        wrap(runner.decode_graphs, "replay", "graph_replay")
    return totals


def bench_kvpilot_throughput(path: Path, prompts, out_lens, async_scheduling: str = "auto",
                             phases: bool = False) -> dict:
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.entrypoints.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(str(path), load_format="dummy", max_model_len=4096, max_num_seqs=256,
              max_num_batched_tokens=16384, **scheduling_arg(async_scheduling))
    startup_s = time.perf_counter() - t0
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))  # warm-up, as nano-vllm does
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    runner = llm.engine.runner
    # the phase timers synchronise after every call, which serialises async scheduling:
    # the headline number is measured without them
    timed = time_phases(runner) if phases else None
    sync()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    sync()
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"phases_s": timed, "model_s": timed and timed["execute"],
              "steps": timed and timed["execute_calls"],
              "requests": len(prompts), "output_tokens": produced,
              "requested_tokens": sum(out_lens), "elapsed_s": elapsed,
              "output_tok_per_s": produced / elapsed, "startup_s": startup_s,
              "num_kv_blocks": runner.num_blocks,
              "graph_replays": runner.decode_graphs.num_replays if runner.decode_graphs else 0,
              "async_scheduling": getattr(llm.engine, "async_scheduling", None)}
    del llm, runner, outputs
    free_gpu()
    return result


def bench_hf_throughput(config: dict, prompts, out_lens) -> dict:
    """Gives HF generate's output tokens/s on a left-padded static batch of the requests."""
    import transformers

    cfg = transformers.Qwen3Config(**{k: v for k, v in config.items()
                                      if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(dtype=torch.bfloat16, device=DEVICE).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    new = max(out_lens)
    kwargs = {"do_sample": True, "temperature": 0.6, "top_k": 0, "top_p": 1.0,
              "pad_token_id": 0, "eos_token_id": None}
    with torch.inference_mode():
        model.generate(ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4,
                       min_new_tokens=4, **kwargs)
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             **kwargs)
        sync()
    elapsed = time.perf_counter() - t0
    useful = sum(out_lens)  # a static batch computes max(out_lens) steps for every row
    result = {"requests": len(prompts), "generated_tokens": int(out[:, width:].numel()),
              "useful_output_tokens": useful, "elapsed_s": elapsed,
              "output_tok_per_s": useful / elapsed, "transformers": transformers.__version__}
    del model, out
    free_gpu()
    return result


def bench_batch1_decode(path: Path, copy_gbps: float, prompt_len: int = 128,
                        new_tokens: int = 256, profile_to: Path | None = None,
                        async_scheduling: str = "auto") -> dict:
    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(path), load_format="dummy", max_model_len=2048, max_num_seqs=4,
        **scheduling_arg(async_scheduling)))
    model = engine.runner.model
    embed = model.model.embed_tokens.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                       if p is not embed)  # decode reads one embedding row, every other weight
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=new_tokens)
    rng = random.Random(1)
    for run in ("warm-up", "timed"):
        engine.add_request(run, [rng.randint(0, 10000) for _ in range(prompt_len)], params)
        engine.step()  # the prefill and the first token
        sync()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        sync()
        elapsed = time.perf_counter() - t0
    # timed: the other new_tokens - 1 tokens (async scheduling reads the first one back in
    # the loop's first step and needs one more step() to read the last one)
    steps = new_tokens - 1
    if profile_to is not None:
        profile_host(engine, [rng.randint(0, 10000) for _ in range(prompt_len)], params,
                     profile_to)
    graphs = engine.runner.decode_graphs
    replay_ms = float(do_bench(graphs.graphs[1].replay, warmup=25, rep=200,
                               return_mode="median")) if graphs else float("nan")
    roofline_ms = weight_bytes / copy_gbps / 1e6
    # the graph holds the layers, not the LM head (run eagerly on the sampled rows)
    head_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    graph_roofline_ms = (weight_bytes - head_bytes) / copy_gbps / 1e6
    engine_ms = elapsed / steps * 1e3
    result = {"weight_bytes": weight_bytes, "copy_gbps": copy_gbps, "roofline_ms": roofline_ms,
              "engine_ms_per_token": engine_ms, "engine_of_roofline": roofline_ms / engine_ms,
              "graph_replay_ms": replay_ms, "graph_roofline_ms": graph_roofline_ms,
              "graph_of_roofline": graph_roofline_ms / replay_ms,
              "decode_steps": steps, "prompt_len": prompt_len,
              "async_scheduling": getattr(engine, "async_scheduling", None)}
    del engine, model, embed, graphs
    free_gpu()
    return result


def scheduling_arg(mode: str) -> dict[str, str]:
    """Gives the engine argument for `--async-scheduling`: none for auto, so the script also
    runs an engine tree from before the option (bench/e2e_gpu_ab.sh's base side)."""
    return {} if mode == "auto" else {"async_scheduling": mode}


def phase_text(k: dict) -> str:
    """Gives where the throughput run's time went, in seconds."""
    p = k["phases_s"]
    if p is None:
        return f"async scheduling {'on' if k.get('async_scheduling') else 'off'}, phases not timed"
    rest = k["elapsed_s"] - p["execute"]
    return (f"model call {p['execute']:.1f} s = build batch {p.get('build_batch', 0):.1f} + "
            f"graph replay {p.get('graph_replay', 0):.1f} + eager forward "
            f"{p.get('eager_forward', 0):.1f} + LM head {p.get('lm_head', 0):.1f} + other; "
            f"sampling, scheduling, outputs {rest:.1f} s")


def profile_host(engine, prompt: list[int], params, path: Path) -> None:
    """Writes where the host time of one batch-1 request goes (cProfile, top 30 by own time)."""
    import cProfile
    import io
    import pstats

    engine.add_request("profiled", prompt, params)
    profiler = cProfile.Profile()
    profiler.enable()
    while engine.has_unfinished_requests():
        engine.step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    path.write_text(text.getvalue())


def markdown(r: dict) -> str:
    lines = [f"# kvpilot end to end on {r['gpu']} ({r['date']})", "",
             f"torch {r['torch']}; device-to-device copy {r['copy_gbps']:.0f} GB/s.", "",
             "| benchmark | kvpilot | baseline | ratio | goal |", "|---|---|---|---|---|"]
    if "throughput" in r:
        k, h = r["throughput"]["kvpilot"], r["throughput"].get("hf")
        base = (f"HF generate {h['output_tok_per_s']:.0f} tok/s ({h['requests']} requests, "
                "static batch)") if h else "HF not run"
        ratio = f"{k['output_tok_per_s'] / h['output_tok_per_s']:.1f}x" if h else "-"
        lines.append(f"| c) Qwen3-0.6B shape, {k['requests']} requests (seed "
                     f"{r.get('seed', 0)}), in/out 100-1024 | "
                     f"{k['output_tok_per_s']:.0f} output tok/s ({k['output_tokens']} tokens in "
                     f"{k['elapsed_s']:.1f} s; {k['steps'] or '?'} steps: " + phase_text(k) + ") | "
                     f"{base} | {ratio} | >= 15000 tok/s |")
    if "batch1" in r:
        d = r["batch1"]
        lines.append(f"| d) Llama-3-8B shape, batch 1 decode | {d['engine_ms_per_token']:.2f} "
                     f"ms/token (graph replay alone {d['graph_replay_ms']:.2f} ms) | roofline "
                     f"{d['roofline_ms']:.2f} ms ({d['weight_bytes'] / 1e9:.2f} GB weights) | "
                     f"{d['engine_of_roofline']:.2f} of roofline (replay {d['graph_of_roofline']:.2f} of "
                     f"its own {d['graph_roofline_ms']:.2f} ms: layers without the LM head) | "
                     ">= 0.75 |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--only", choices=["c", "d"], default=None)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--hf-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="c)'s prompts and lengths")
    parser.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--phases", action="store_true",
                        help="time c)'s phases (synchronises every step: slower)")
    parser.add_argument("--profile", action="store_true", help="cProfile d)'s host side")
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "copy_gbps": copy_bandwidth()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fast_dummy_weights()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "c"):
            prompts, out_lens = recipe(args.requests, args.seed)
            result["seed"] = args.seed
            path = model_dir(Path(tmp), "qwen3-0.6b-shape", QWEN3_0_6B)
            result["throughput"] = {"kvpilot": bench_kvpilot_throughput(
                path, prompts, out_lens, args.async_scheduling, args.phases)}
            print(json.dumps(result["throughput"]), flush=True)
            n = args.hf_requests
            if n:
                result["throughput"]["hf"] = bench_hf_throughput(QWEN3_0_6B, prompts[:n],
                                                                 out_lens[:n])
        if args.only in (None, "d"):
            path = model_dir(Path(tmp), "llama3-8b-shape", LLAMA3_8B)
            result["batch1"] = bench_batch1_decode(
                path, result["copy_gbps"], profile_to=out / "profile_d.txt" if args.profile else None,
                async_scheduling=args.async_scheduling)
    # c) and d) run as separate processes so that each gets the whole GPU
    stem = f"e2e_gpu_{args.only}" if args.only else "e2e_gpu"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (out / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
