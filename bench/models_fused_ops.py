"""Model step time on a GPU with the torch seams vs the fused Triton kernels, side by side.

Same weights, same batch, same run: an 8B-shaped Llama and Qwen3 (first N layers only:
time per step scales with layers) in bf16, Triton attention, dummy weights. Times a
batch-1 decode step eagerly and as a CUDA-graph replay, a batch-64 decode step and a
2048-token prefill, with `fused_kernels` off and on, and prints the speed-ups.

    python bench/models_fused_ops.py [--layers 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
SHAPES = {
    "llama-8b": {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                 "intermediate_size": 14336, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0},
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
                 "intermediate_size": 12288, "num_attention_heads": 32, "head_dim": 128,
                 "num_key_value_heads": 8, "vocab_size": 151936, "rope_theta": 1000000.0},
}
BLOCK_SIZE = 16


def build(shape: str, layers: int, fused: bool):
    from kvpilot.engine.attention.triton_backend import TritonAttentionBackend
    from kvpilot.engine.models.config import ModelConfig
    from kvpilot.engine.models.loader import load_model

    hf = {**SHAPES[shape], "num_hidden_layers": layers, "max_position_embeddings": 8192}
    config = ModelConfig.from_hf(hf, dtype=torch.bfloat16, max_model_len=8192, name=shape)
    model = load_model(config, "dummy", "cuda", fused_kernels=fused)
    model.attn_backend = TritonAttentionBackend()
    return model


def batch(model, seq_lens: list[int], query_lens: list[int]):
    """Gives (ids, positions, kv_caches, meta) of one step; blocks laid out contiguously."""
    from kvpilot.engine.attention.metadata import AttentionMetadata

    cfg = model.config
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    tables = torch.full((len(seq_lens), max(blocks)), -1, dtype=torch.int32)
    slots, positions, start = [], [], 0
    for i, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        tables[i, :blocks[i]] = torch.arange(start, start + blocks[i])
        for p in range(s - q, s):
            slots.append((start + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE)
            positions.append(p)
        start += blocks[i]
    caches = [torch.zeros(2, start, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                          dtype=cfg.dtype, device="cuda") for _ in range(cfg.num_layers)]
    qsl = torch.tensor([0, *query_lens]).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device="cuda"),
        query_start_loc=qsl.int().cuda(), seq_lens=torch.tensor(seq_lens).int().cuda(),
        block_tables=tables.cuda(), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        num_decode_tokens=sum(q == 1 for q in query_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    ids = torch.randint(0, cfg.vocab_size, (sum(query_lens),), device="cuda")
    return ids, torch.tensor(positions, device="cuda"), caches, meta


def time_step(model, seq_lens, query_lens, graph: bool = False) -> float:
    """Gives the median ms of one forward (plus logits of the last rows)."""
    from triton.testing import do_bench

    ids, pos, caches, meta = batch(model, seq_lens, query_lens)
    last = meta.query_start_loc[1:].long() - 1

    def step():
        return model.compute_logits(model(ids, pos, caches, meta)[last])

    with torch.no_grad():
        step()
        if not graph:
            return do_bench(step, warmup=10, rep=100, return_mode="median")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        return do_bench(g.replay, warmup=10, rep=100, return_mode="median")


CASES = {
    "decode b=1 (eager)": ([1024], [1], False),
    "decode b=1 (CUDA graph)": ([1024], [1], True),
    "decode b=64 (CUDA graph)": ([1024] * 64, [1] * 64, True),
    "prefill 1x2048 (eager)": ([2048], [2048], False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    rows = []
    for shape in SHAPES:
        for fused in (False, True):
            model = build(shape, args.layers, fused)
            for case, (seq, q, graph) in CASES.items():
                rows.append({"model": shape, "case": case, "fused": fused,
                             "ms": time_step(model, seq, q, graph)})
            del model
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    lines = [f"# Model step time: torch seams vs fused Triton kernels ({date})", "",
             f"GPU: {gpu}, torch {torch.__version__}. bf16, dummy weights, Triton attention, "
             f"first {args.layers} layers of each shape, median of do_bench.", "",
             "| model | case | torch ops ms | fused ms | speed-up |", "|---|---|---|---|---|"]
    for shape in SHAPES:
        for case in CASES:
            ms = {r["fused"]: r["ms"] for r in rows if r["model"] == shape and r["case"] == case}
            lines.append(f"| {shape} | {case} | {ms[False]:.3f} | {ms[True]:.3f} | "
                         f"{ms[False] / ms[True]:.2f}x |")
    lines += ["", f"Reproduce: `python bench/models_fused_ops.py --layers {args.layers}`"]
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "models_fused_ops.json").write_text(json.dumps(
        {"gpu": gpu, "date": date, "torch": torch.__version__, "layers": args.layers,
         "rows": rows}, indent=1))
    (RESULTS / "models_fused_ops.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
