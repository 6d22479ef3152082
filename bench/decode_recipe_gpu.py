"""Decode attention over the nano-vllm recipe's own steps (issue 21's 20k tok/s line).

The recipe's GPU time is mostly decode attention (bench/results/recipe_profile-*), and there
it moves KV at a lower rate than the uniform shapes of bench/kernels/attention_bench.py:
the batch shrinks from 256 rows to a few, and the contexts in one step range from 100 to
2,000 tokens. This replays those steps (Qwen3-0.6B's attention: 16 query heads, 8 KV heads,
head_dim 128, bf16, 16-token blocks placed at random) as the engine runs them: the batch
padded to its CUDA-graph bucket, the split count fixed at capture from max_model_len, the
28 layers' launches in one graph (layers rotate over four caches so that small steps do
not run from L2). For each launch variant it prints the summed seconds over the run and the
KV bytes per second, side by side.

    python bench/decode_recipe_gpu.py OUT [--seed 0] [--stride 8]
    python bench/decode_recipe_gpu.py /tmp/out --smoke    # CPU interpreter: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS, CACHES, MAX_MODEL_LEN = 16, 8, 128, 16, 28, 4, 4096


def steps(seed: int, stride: int, num_requests: int = 256) -> list[tuple[int, list[int]]]:
    """Gives every stride-th decode step of the recipe as (step, seq_lens of its rows)."""
    from e2e_gpu import recipe

    prompts, outs = recipe(num_requests, seed)
    lens = [len(p) for p in prompts]
    last = max(outs) - 1  # the first output token comes from prefill
    return [(t, [n + 1 + t for n, o in zip(lens, outs, strict=True) if o - 1 > t])
            for t in range(0, last, stride)]


def engine_tables(seed: int, plan: list[tuple[int, list[int]]], num_requests: int = 256
                  ) -> dict[int, list[list[int]]]:
    """Gives each planned step's block tables as the engine's allocator lays them out: the
    prompts' blocks one after another in arrival order, then each decode block taken from
    the free list when its sequence crosses a block boundary (so those interleave)."""
    from e2e_gpu import recipe

    prompts, outs = recipe(num_requests, seed)
    tables: list[list[int]] = []
    free = 0
    for p in prompts:
        k = -(-(len(p) + 1) // BLOCK)
        tables.append(list(range(free, free + k)))
        free += k
    wanted, out = {t for t, _ in plan}, {}
    for t in range(max(wanted) + 1):
        active = [i for i, o in enumerate(outs) if o - 1 > t]
        for i in active:
            while len(tables[i]) * BLOCK < len(prompts[i]) + 1 + t:
                tables[i].append(free)
                free += 1
        if t in wanted:
            out[t] = [list(tables[i]) for i in active]
    return out


def bucket(n: int, max_num_seqs: int = 256) -> int:
    from kvpilot.engine.worker.cuda_graphs import batch_buckets

    return next(b for b in batch_buckets(max_num_seqs) if b >= n)


def variants(max_model_len: int = MAX_MODEL_LEN) -> dict[str, Callable[[int], dict]]:
    """Gives each launch variant as: padded batch size -> paged_decode_attention kwargs
    (the split count as the engine's graphs fix it, from max_model_len)."""
    from kvpilot.kernels.paged_decode_attention import default_num_splits

    def engine(size: int) -> dict:
        return {"num_splits": default_num_splits(size, KV_HEADS, max_model_len)}

    def at_least(n: int) -> Callable[[int], dict]:
        return lambda size: {"num_splits": max(n, engine(size)["num_splits"])}

    def ordered(**extra) -> Callable[[int], dict]:
        return lambda s: {**engine(s), "longest_first": True, **extra}

    def split_under(programs_per_sm: int) -> Callable[[int], dict]:
        """two splits (at least) while the batch gives fewer programs than that per SM"""
        def kwargs(size: int) -> dict:
            splits = engine(size)["num_splits"]
            if size * KV_HEADS < programs_per_sm * 132:
                splits = max(2, splits)
            return {"num_splits": splits, "longest_first": True}
        return kwargs

    return {
        "row order": engine,
        "longest-first": ordered(),
        "longest-first, block_n 128, 2 stages": ordered(block_n=128, num_stages=2),
        "longest-first, 2 stages": ordered(num_stages=2),
        "longest-first, 4 stages": ordered(num_stages=4),
        "longest-first, splits >= 2": lambda s: {**at_least(2)(s), "longest_first": True},
        "longest-first, 2 splits under 3 programs an SM": split_under(3),
    }


def load_kernel(path: Path) -> Callable:
    """Gives `paged_decode_attention` of the file at `path` (another commit's, a variant)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.paged_decode_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stride", type=int, default=8, help="time every stride-th step")
    parser.add_argument("--uniform", action="store_true",
                        help="attention_bench's two decode shapes (32 q heads) instead")
    parser.add_argument("--layout", choices=["random", "engine"], default="random",
                        help="blocks at random, or as the engine's allocator places them")
    parser.add_argument("--before-kernel", type=Path,
                        help="a paged_decode_attention.py to time as 'before' (git show BASE:...)")
    parser.add_argument("--other-kernel", type=Path,
                        help="a paged_decode_attention.py to time beside, longest-first")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from e2e_gpu import copy_bandwidth

    from kvpilot.kernels.paged_decode_attention import paged_decode_attention

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    plan = steps(args.seed, args.stride)
    heads = HEADS
    if args.uniform:
        plan, heads, args.stride = [(4096, [4096] * 64), (1024, [1024] * 256)], 32, 1
    if args.smoke:  # two small steps
        plan = [(t, lens[:3]) for t, lens in plan[:: len(plan) // 2][:2]]
        plan = [(t, [min(n, 40) for n in lens]) for t, lens in plan]
    # room for the largest step's blocks, placed at random among half again as many
    num_blocks = max(sum(-(-n // BLOCK) for n in lens) for _, lens in plan) * 3 // 2
    laid_out = None
    if args.layout == "engine" and not args.uniform and not args.smoke:
        laid_out = engine_tables(args.seed, plan)
        num_blocks = 1 + max(b for rows in laid_out.values() for r in rows for b in r)
    caches = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
              for _ in range(1 if args.smoke else CACHES)]
    scale = HEAD_DIM ** -0.5
    table = variants(256 if args.smoke else MAX_MODEL_LEN)  # smoke: fewer splits to interpret
    kernels = dict.fromkeys(table, paged_decode_attention)
    if args.before_kernel:  # the launcher of another commit, same arguments less `order`
        table = {"before": table["row order"], **table}
        kernels["before"] = load_kernel(args.before_kernel)
    if args.other_kernel:  # a variant of this launcher, `order` included
        table["other kernel, longest-first"] = table["longest-first"]
        kernels["other kernel, longest-first"] = load_kernel(args.other_kernel)
    results: dict[str, dict] = {name: {"s": 0.0, "steps": {}} for name in table}
    total_bytes = 0.0
    copy_gbps = 0.0 if args.smoke else copy_bandwidth()
    for t, lens in plan:
        n, size = len(lens), bucket(len(lens))
        need = [-(-x // BLOCK) for x in lens]
        perm = torch.randperm(num_blocks)[:sum(need)]
        tables = torch.zeros(size, max(need), dtype=torch.int32)
        at = 0
        for row, k in enumerate(need):
            tables[row, :k] = perm[at:at + k] if laid_out is None else \
                torch.tensor(laid_out[t][row][:k])
            at += k
        tables = tables.to(device)
        seq_lens = torch.zeros(size, dtype=torch.int32)
        seq_lens[:n] = torch.tensor(lens, dtype=torch.int32)
        seq_lens = seq_lens.to(device)
        q = torch.randn(size, heads, HEAD_DIM, dtype=dtype, device=device)
        out = torch.empty_like(q)
        step_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * q.element_size() * LAYERS
        total_bytes += step_bytes * args.stride
        reference = None
        for name, kwargs_of in table.items():
            kwargs = dict(kwargs_of(size))
            if kwargs.pop("longest_first", False):
                kwargs["order"] = torch.argsort(seq_lens, descending=True).to(torch.int32)

            def layers(kwargs=kwargs, kernel=kernels[name], q=q, tables=tables,
                       seq_lens=seq_lens, out=out) -> None:
                for layer in range(LAYERS if not args.smoke else 1):
                    kernel(q, caches[layer % len(caches)], tables, seq_lens, scale, out=out,
                           **kwargs)

            layers()
            if reference is None:
                reference = out[:n].float().clone()
            else:
                err = (out[:n].float() - reference).abs().max().item()
                assert err < 2e-2, f"{name}: max error {err} at step {t}"
            if args.smoke:
                continue
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layers()
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 3 / 1e3
            results[name]["s"] += seconds * args.stride
            results[name]["steps"][t] = step_bytes / seconds / 1e9
            del graph
        print(f"step {t}: {n} rows, {step_bytes / 1e9:.2f} GB", file=sys.stderr)
    base = results[next(iter(results))]["s"]
    lines = [f"# Decode attention over the recipe's steps (seed {args.seed}, every "
             f"{args.stride}th step timed, blocks laid out: {args.layout})", "",
             f"{torch.cuda.get_device_name() if not args.smoke else 'CPU'}; "
             f"copy {copy_gbps:.0f} GB/s; KV bytes over the run {total_bytes / 1e12:.2f} TB", "",
             "| variant | seconds over the run | GB/s | of copy | first row / variant |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        s = r["s"]
        gbps = total_bytes / s / 1e9 if s else 0.0
        r.update(gbps=gbps, of_copy=gbps / copy_gbps if copy_gbps else 0.0,
                 speedup=base / s if s else 0.0)
        lines.append(f"| {name} | {s:.3f} | {gbps:.0f} | {r['of_copy']:.3f} | "
                     f"{r['speedup']:.3f} |")
    if args.uniform:
        lines += ["", "| variant | " + " | ".join(f"GB/s, step {t}" for t, _ in plan) + " |",
                  "|---|" + "---|" * len(plan)]
        lines += [f"| {name} | " + " | ".join(f"{gbps:.0f}" for gbps in r["steps"].values())
                  + " |" for name, r in results.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_recipe.json").write_text(json.dumps(
        {"seed": args.seed, "stride": args.stride, "copy_gbps": copy_gbps,
         "kv_bytes": total_bytes, "variants": results}, indent=1))
    (args.out / "decode_recipe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
