"""Where a LoRA decode step's time goes: one layer's four seams (q|k|v, o, gate|up, down)
of `lora_sgmv_` at batch 64 over 8 adapters of rank 16 (8 tokens each), as the engine
runs them (one grouping and one zeroed workspace per forward, then the seams), per model
shape and expand variant, side by side in one process.

Variants: `padded` (expand reads the whole stacked rank of a merged seam, zeros
included: the kernel before `parts`), `parts` (each column block reads its own part's
rank columns), each at expand BLOCK_N 64 and 128. Timed as one CUDA graph over every
layer of the shape, each layer with its own weights (so none stays in L2), replayed
7 times: us per layer (median), the bytes a layer must move (A and B of the 8 slots,
x read, out read and written; padded counts the zeros it reads) and those bytes over the
time. The base model's own layer (its GEMMs at batch 64) is timed the same way for scale.
Prints a JSON line per shape.

    python3 bench/kernels/lora_sgmv_gpu.py [--shapes 0.6b,8b]   # one GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shapes import LLAMA3_8B, QWEN3_0_6B
from w8a16_gemv_gpu import graph_time_us

from kvpilot.kernels.lora_sgmv import group_by_slot, lora_sgmv_

SHAPES = {"0.6b": QWEN3_0_6B, "8b": LLAMA3_8B}
TOKENS, SLOTS, RANK = 64, 8, 16


def seams(config: dict) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Gives seam -> (K, its parts' output rows)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    return {"qkv": (hidden, (q, kv, kv)), "o": (q, (hidden,)),
            "gate_up": (hidden, (inter, inter)), "down": (inter, (hidden,))}


def run_shape(name: str) -> dict:
    config = SHAPES[name]
    layers = config["num_hidden_layers"]
    dtype, dev = torch.bfloat16, torch.device("cuda")
    shapes = seams(config)
    slots = torch.arange(TOKENS, dtype=torch.int32, device=dev) % SLOTS
    weights = []  # per layer: seam -> (x, a, b, out, base weight)
    for _ in range(layers):
        layer = {}
        for seam, (k, parts) in shapes.items():
            n, rank = sum(parts), RANK * len(parts)
            b = torch.zeros(SLOTS, n, rank, dtype=dtype, device=dev)
            first = 0
            for p, rows in enumerate(parts):
                b[:, first:first + rows, p * RANK:(p + 1) * RANK] = 0.01
                first += rows
            layer[seam] = (torch.randn(TOKENS, k, dtype=dtype, device=dev),
                           torch.randn(SLOTS, rank, k, dtype=dtype, device=dev) * 0.01, b,
                           torch.zeros(TOKENS, n, dtype=dtype, device=dev),
                           torch.randn(n, k, dtype=dtype, device=dev) * 0.01)
        weights.append(layer)
    width = max(RANK * len(parts) for _, parts in shapes.values())
    out: dict = {"shape": name, "tokens": TOKENS, "adapters": SLOTS, "rank": RANK,
                 "layers": layers}

    def lora_layer(i: int, use_parts: bool, block_n: int) -> None:
        grouped = group_by_slot(slots, SLOTS)
        workspace = torch.zeros(len(shapes), TOKENS, width, dtype=torch.float32, device=dev)
        for j, (seam, (_, parts)) in enumerate(shapes.items()):
            x, a, b, o, _ = weights[i][seam]
            lora_sgmv_(o, x, a, b, grouped, block_n=block_n,
                       tmp=workspace[j, :, :a.shape[1]], parts=parts if use_parts else ())

    def base_layer(i: int) -> None:
        for x, _, _, o, w in weights[i].values():
            torch.mm(x, w.T, out=o)

    out["base_layer_us"] = round(graph_time_us(base_layer, calls=layers), 2)
    base_bytes = sum(seam[4].numel() * 2 for seam in weights[0].values())
    out["base_layer_tbps"] = round(base_bytes / out["base_layer_us"] / 1e6, 2)
    for use_parts in (False, True):
        for block_n in (64, 128):
            variant = f"{'parts' if use_parts else 'padded'}_bn{block_n}"
            us = graph_time_us(lambda i, p=use_parts, bn=block_n: lora_layer(i, p, bn),
                               calls=layers)
            moved = 0
            for x, a, b, o, _ in weights[0].values():
                b_read = b.numel() * 2 // (1 if not use_parts else a.shape[1] // RANK)
                moved += a.numel() * 2 + b_read + x.numel() * 2 + 2 * o.numel() * 2
            out[f"{variant}_us_per_layer"] = round(us, 2)
            out[f"{variant}_tbps"] = round(moved / us / 1e6, 2)
    # the same outputs either way (the zeros it skips add nothing)
    for seam, (_, parts) in shapes.items():
        x, a, b, _, _ = weights[0][seam]
        grouped = group_by_slot(slots, SLOTS)
        padded = lora_sgmv_(torch.zeros(TOKENS, b.shape[1], dtype=dtype, device=dev), x, a, b,
                            grouped)
        split = lora_sgmv_(torch.zeros_like(padded), x, a, b, grouped, parts=parts)
        out[f"max_abs_diff_{seam}"] = float((padded.float() - split.float()).abs().max())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shapes", default="0.6b,8b")
    args = parser.parse_args()
    print(json.dumps({"gpu": torch.cuda.get_device_name()}))
    for name in args.shapes.split(","):
        print(json.dumps(run_shape(name)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
