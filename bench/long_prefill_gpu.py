"""Issue 44 item 5: a 131,072-token prompt's prefill (Llama-3-8B shape) in TFLOP/s.

The engine prefills a long prompt in chunks of --max-num-batched-tokens (default 8192): every
chunk after the first attends a cached prefix in the paged cache. Two measurements, each
with its baseline in the same process:

a) kernel: one layer's prefill attention over every chunk of the prompt (32 heads, 8 KV
   heads, d128, bf16, 16-token blocks shuffled in the cache), the chunks' causal FLOPs
   (4 * d * heads * keys attended, summed) over the sum of each chunk's median time, for
   the default launch (the Gluon kernel on keys gathered from the cache, gather included),
   the Triton TMA kernel that read the prefix from the cache before (`use_gluon=False`),
   and, as the strongest baseline torch offers, the fastest of its SDPA backends over the
   whole prompt unchunked (contiguous K/V, the same FLOPs);
b) engine (`--parts engine`): the time from `generate` to the first token of one 131,072-token
   prompt on dummy weights (prefix caching off, a fresh random prompt each run), as model
   TFLOP/s (2 x non-embedding parameters per token for the projections plus the attention
   FLOPs of a), with the gather path on and off in turn (`GATHER_PREFIX`), twice each.

Writes long_prefill.json to --out.

    python bench/long_prefill_gpu.py --out DIR [--parts kernel,engine]
    TRITON_INTERPRET=1 python bench/long_prefill_gpu.py --smoke --out DIR   # CPU, tiny, a) only
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from shapes import LLAMA3_8B, write_model_dir

from kvpilot.kernels import prefill_attention_gluon as gluon_kernel
from kvpilot.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)


def median_s(fn, reps: int) -> float:
    """Median wall time of `fn` over `reps` runs after one warm-up (synchronised)."""
    cuda = torch.cuda.is_available()
    fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def chunk_flops(prefix: int, q_len: int, heads: int, head_dim: int) -> float:
    """Causal attention FLOPs of q_len queries after `prefix` cached keys (QK^T and PV)."""
    keys = q_len * prefix + q_len * (q_len + 1) / 2
    return 4.0 * head_dim * heads * keys


def kernel_part(tokens: int, chunk: int, heads: int, kv_heads: int, head_dim: int,
                block_size: int, reps: int, device: str, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    num_blocks = -(-tokens // block_size)
    order = torch.randperm(num_blocks, generator=gen)
    tables = order.to(torch.int32).view(1, -1).to(device)
    k_all = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_all = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    q_all = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype).to(device)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype,
                        device=device)
    pos = torch.arange(tokens, device=device)
    slots = (tables[0, pos // block_size].long(), pos % block_size)
    cache[0][slots] = k_all
    cache[1][slots] = v_all
    scale = head_dim**-0.5
    rows: list[dict] = []
    cuda = device == "cuda"  # (the Gluon kernel runs on a Hopper GPU only)
    variants = [("gluon", None), ("triton", False)] if cuda else [("triton", False)]
    totals = dict.fromkeys([name for name, _ in variants], 0.0)
    flops_total = 0.0
    for prefix in range(0, tokens, chunk):
        q_len = min(chunk, tokens - prefix)
        q, k, v = (x[prefix:prefix + q_len] for x in (q_all, k_all, v_all))
        starts = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        lens = torch.tensor([prefix + q_len], dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        host = {"query_start_loc_cpu": [0, q_len], "seq_lens_cpu": [prefix + q_len]}

        def run(use_gluon, q=q, k=k, v=v, starts=starts, lens=lens, out=out, q_len=q_len,
                host=host):
            return paged_prefill_attention(q, k, v, cache, tables, starts, lens, q_len, scale,
                                           out=out, max_prefix_len=None, use_gluon=use_gluon,
                                           **host)

        flops = chunk_flops(prefix, q_len, heads, head_dim)
        flops_total += flops
        row: dict[str, float] = {"prefix": prefix, "q_len": q_len}
        ref = run(False).clone()
        if not cuda:  # (the float32 reference of a 131k prompt would not fit a GPU)
            exact = paged_prefill_attention_ref(q, k, v, cache, tables, starts, lens, scale)
            row["triton_rel_err_vs_ref"] = ((ref - exact).norm() / exact.norm()).item()
        for name, use in variants:
            if name == "gluon":
                got = run(None)
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                row["gluon_rel_err_vs_triton"] = err
                assert err < 2e-2, f"gluon and triton disagree at prefix {prefix}: {err}"
            seconds = median_s(lambda use=use: run(use), reps)
            totals[name] += seconds
            row[f"{name}_ms"] = seconds * 1e3
            row[f"{name}_tflops"] = flops / seconds / 1e12
        if cuda:  # the gather's share of the default launch
            row["gather_ms"] = 1e3 * median_s(lambda k=k, v=v, lens=lens, host=host: (
                gluon_kernel.gather_prefixed_kv(k, v, cache, tables, lens,
                                                host["query_start_loc_cpu"],
                                                host["seq_lens_cpu"])), reps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"tokens": tokens, "chunk": chunk, "heads": heads, "kv_heads": kv_heads,
              "head_dim": head_dim, "block_size": block_size, "chunks": rows,
              "flops": flops_total}
    for name, seconds in totals.items():
        result[f"{name}_tflops"] = flops_total / seconds / 1e12
    result["whole_prompt_flops"] = chunk_flops(0, tokens, heads, head_dim)
    result["sdpa"] = sdpa_whole(q_all, k_all, v_all, heads, scale, reps)
    best = max(result["sdpa"].values(), default=None)
    result["sdpa_best_tflops"] = best
    if best and "gluon_tflops" in result:
        result["gluon_vs_sdpa"] = result["gluon_tflops"] / best
    return result


def sdpa_whole(q, k, v, heads: int, scale: float, reps: int) -> dict:
    """TFLOP/s of torch's SDPA backends over the whole prompt, causal, unchunked: torch's own
    pick and each backend forced (those that run here)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tokens, _, head_dim = q.shape
    flops = chunk_flops(0, tokens, heads, head_dim)
    qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    found = {}
    choices = [("pick", None)]
    if q.is_cuda:
        choices += [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                    ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    for name, backend in choices:
        def run(backend=backend):
            attend = torch.nn.functional.scaled_dot_product_attention
            if backend is None:
                return attend(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
            with sdpa_kernel(backend):
                return attend(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
        try:
            found[name] = flops / median_s(run, reps) / 1e12
        except RuntimeError as err:  # a backend that does not take these shapes here
            print(f"sdpa {name}: {str(err).splitlines()[0]}", flush=True)
    return found


def engine_part(tokens: int, chunk: int, runs: int) -> dict:
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.entrypoints.llm import LLM

    config = {**LLAMA3_8B, "max_position_embeddings": tokens + 1024}
    path = write_model_dir(Path(tempfile.mkdtemp()) / "llama3-8b-long", config)
    llm = LLM(str(path), load_format="dummy", max_model_len=tokens + 16, max_num_seqs=8,
              max_num_batched_tokens=chunk, enable_prefix_caching=False)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def prompt(n):
        return {"prompt_token_ids": [rng.randrange(1000, 120000) for _ in range(n)]}

    llm.generate([prompt(4 * chunk)], params)  # warm-up: every chunk width, a prefix
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    inter, heads, kv_heads = (config["intermediate_size"], config["num_attention_heads"],
                              config["num_key_value_heads"])
    head_dim = config["head_dim"]
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden \
        + 3 * hidden * inter
    linear = 2.0 * layers * per_layer * tokens
    attention = layers * chunk_flops(0, tokens, heads, head_dim)
    timings: dict[str, list[float]] = {"gather": [], "triton": []}
    for _ in range(runs):
        for name, on in (("gather", True), ("triton", False)):
            gluon_kernel.GATHER_PREFIX = on
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate([prompt(tokens)], params)
            torch.cuda.synchronize()
            timings[name].append(time.perf_counter() - t0)
            print(f"engine {name}: {timings[name][-1]:.2f} s", flush=True)
    gluon_kernel.GATHER_PREFIX = True
    result = {"tokens": tokens, "chunk": chunk, "linear_flops": linear,
              "attention_flops": attention, "seconds": timings}
    for name, seconds in timings.items():
        result[f"{name}_tflops"] = (linear + attention) / min(seconds) / 1e12
    result["gather_vs_triton"] = min(timings["triton"]) / min(timings["gather"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--parts", default="kernel", help="kernel (a), engine (b), or both")
    parser.add_argument("--engine-runs", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, a) only")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, object]
    if args.smoke:
        result = {"kernel": kernel_part(96, 32, 4, 2, 16, 16, 1, "cpu", torch.float32)}
    else:
        parts = args.parts.split(",")
        result = {"device": torch.cuda.get_device_name()}
        if "kernel" in parts:
            result["kernel"] = kernel_part(args.tokens, args.chunk, 32, 8, 128, 16, args.reps,
                                           "cuda", torch.bfloat16)
        if "engine" in parts:
            result["engine"] = engine_part(args.tokens, args.chunk, args.engine_runs)
    result["command"] = " ".join(sys.argv)
    (out / "long_prefill.json").write_text(json.dumps(result, indent=1))
    kernel = result.get("kernel")
    if isinstance(kernel, dict):
        print(json.dumps({k: v for k, v in kernel.items() if k != "chunks"}, indent=1))
    if "engine" in result:
        print(json.dumps(result["engine"], indent=1))


if __name__ == "__main__":
    main()
