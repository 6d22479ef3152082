"""Issue 44: the engine's mask fill at batch 64, whole against the vocabulary split (decision
0139), on this host's CPUs, with no GPU: what the split buys where the threads are.

Drives `GrammarMatchers` as the engine does, one process per setting of
`KVPILOT_MASK_SPLIT`: 64 requests of `structured_gpu.SCHEMA` (bounded strings, numbers, an
enum) on the synthetic tokenizer of the Qwen3-0.6B shape (151,936 ids), each step filling the
batch's mask (`start_bitmask` + `wait`, as the engine's background fill) and then having
every row take a random allowed token in one `accept_tokens` (as the engine's accept), a
finished request replaced at once. Warm-up steps spread the rows over the object first.

Reported per setting (ms per step, median and p90 over the timed steps): the fill
(`fill_seconds`), the engine thread's part of starting it (`start_bitmask` until it
returns), and the accept; plus how many rows the parts filled.

    python bench/structured_mask_split.py OUT_DIR [--splits 1,4,8] [--steps 150] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from fresh_process import call_in_fresh_process
from structured_gpu import QWEN3_0_6B, SCHEMA, synthetic_tokenizer


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered) * 1e3, 3),
            "p90": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 3)}


def run_split(tokenizer_json: str, eos: int, parts: int, warm: int, steps: int,
              batch: int) -> dict:
    """Gives one setting's fill, start and accept ms per step (this process: fresh
    matchers, fresh llguidance threads)."""
    os.environ["KVPILOT_MASK_SPLIT"] = str(parts)
    import torch

    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
    from kvpilot.engine.core.request import Request
    from kvpilot.engine.structured.matchers import GrammarMatchers, fill_threads

    vocab = QWEN3_0_6B["vocab_size"]
    grammars = GrammarMatchers(tokenizer_json, vocab, [eos], torch.device("cpu"), "guidance")
    params = SamplingParams(temperature=1.0, max_tokens=10**6, structured_outputs=
                            StructuredOutputsParams(json=json.dumps(SCHEMA)))
    rng = random.Random(0)
    ids = iter(range(10**9))

    def new_seq():  # a request whose matchers (and parts) are compiled
        request = Request(f"r{next(ids)}", None, [5], params, 0.0)
        grammars.add(request)
        for pending in (request.grammar, request.grammar_parts):
            if hasattr(pending, "result"):
                pending.result()  # pyright: ignore[reportAttributeAccessIssue]
        return request.seqs[0]

    seqs = [new_seq() for _ in range(batch)]
    bit = torch.arange(8, dtype=torch.uint8)
    times: dict[str, list[float]] = {"fill": [], "start": [], "accept": []}
    finished = 0
    for step in range(warm + steps):
        began = time.perf_counter()
        fill = grammars.start_bitmask(seqs)
        started = time.perf_counter() - began
        assert fill is not None
        mask = fill.wait()
        allowed = ((mask.view(torch.uint8)[:, :, None] >> bit) & 1).flatten(1)[:, :vocab]
        tokens = []
        for row in range(batch):
            choices = allowed[row].nonzero().flatten()
            tokens.append(int(choices[rng.randrange(len(choices))]))
        began = time.perf_counter()
        grammars.accept_tokens(list(zip(seqs, tokens, strict=True)))
        accepted = time.perf_counter() - began
        if step >= warm:
            times["fill"].append(grammars.fill_seconds)
            times["start"].append(started)
            times["accept"].append(accepted)
        for row, seq in enumerate(seqs):
            matcher = grammars._resolved(seq.request)
            if matcher is None or matcher.is_stopped():
                seqs[row] = new_seq()
                finished += step >= warm
    out = {"parts": parts, "batch": batch, "steps": steps, "fill_threads": fill_threads(),
           "rows_filled_by_parts": grammars.split_rows, "outputs_finished": finished,
           **{f"{name}_ms": _ms(values) for name, values in times.items()}}
    grammars.shutdown()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--splits", default="1,4,8")
    parser.add_argument("--warm", type=int, default=40)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="8 rows, a few steps (CPU check)")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.warm, args.steps = 8, 3, 10
    args.out.mkdir(parents=True, exist_ok=True)
    body = synthetic_tokenizer(QWEN3_0_6B["vocab_size"])
    tokenizer_json, eos = json.dumps(body), body["added_tokens"][2]["id"]
    rows = []
    for parts in (int(p) for p in args.splits.split(",")):
        rows.append(call_in_fresh_process(run_split, tokenizer_json, eos, parts, args.warm,
                                          args.steps, args.batch, reuse_imports=False))
        print(json.dumps(rows[-1]), flush=True)
    result = {"cpus": len(os.sched_getaffinity(0)), "rows": rows}
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    lines = [f"{result['cpus']} CPUs, batch {args.batch}, {args.steps} steps\n",
             "| parts | fill ms (median / p90) | engine thread's start ms | accept ms | rows "
             "filled by parts |", "|---|---|---|---|---|"]
    lines += [f"| {r['parts']} | {r['fill_ms']['median']} / {r['fill_ms']['p90']} | "
              f"{r['start_ms']['median']} | {r['accept_ms']['median']} | "
              f"{r['rows_filled_by_parts']} |" for r in rows]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
