"""The ITL the engine alone gives at request rate inf: issue 17's recipe through a model of step times.

All 256 requests of the nano-vllm recipe arrive at once. The scheduler's rule
(`core/scheduler.py`): running decodes first, one token each, then prefill
chunks first come first served, under `max_num_batched_tokens`, at most
`max_num_seqs` running. A request whose prefill ends early in the burst then
decodes inside the steps that still carry the others' prefill chunks: each of
those steps is one long ITL for it. Steps take

    decode-only step (CUDA graph): decode_ms + decode_us_per_seq * decodes
    mixed step (eager, prefill tokens P): mixed_ms + prefill_us_per_token * P
                                          + decode_us_per_seq * decodes

with defaults fitted to the H100 runs of 2026-11-26 (serve_vs_offline-H100-*.md):
the burst's prefill phase lasted ~670 ms at a 16,384-token budget (~9.5 steps)
and ~1,190 ms at 4,096 (~38 steps), so a mixed step is ~18 ms + 3.2 us per
prefill token; a decode step of 256 sequences took ~9 ms (ITL p50). The
model's total time is printed beside the offline elapsed time as a check.
Delivery is perfect here: every token reaches its reader when its step ends,
so what this gives is the tail the engine itself puts in the ITLs.

    python bench/itl_step_model.py [--budgets 16384,4096,2048] [--max-prefill-in-mixed N]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from serve_vs_offline import recipe

from kvpilot.engine.loadgen.report import percentile


@dataclass(frozen=True)
class StepCosts:
    """Step times in milliseconds (see the module docstring)."""

    decode_ms: float = 4.0
    decode_us_per_seq: float = 20.0
    mixed_ms: float = 13.0
    prefill_us_per_token: float = 3.2

    def step_ms(self, decodes: int, prefill_tokens: int) -> float:
        per_seq = self.decode_us_per_seq * decodes / 1e3
        if prefill_tokens == 0:
            return self.decode_ms + per_seq
        return self.mixed_ms + self.prefill_us_per_token * prefill_tokens / 1e3 + per_seq


def simulate(prompt_lens: list[int], out_lens: list[int], budget: int, max_num_seqs: int,
             costs: StepCosts, max_prefill_in_mixed: int | None = None
             ) -> tuple[list[float], float]:
    """Gives every ITL (ms) and the total time (ms) of the burst under the scheduler's rule;
    `max_prefill_in_mixed` bounds the prefill tokens of a step that also carries decodes."""
    left_prefill = list(prompt_lens)
    left_out = list(out_lens)
    last_token: list[float | None] = [None] * len(prompt_lens)
    waiting = list(range(len(prompt_lens)))
    running: list[int] = []
    itls: list[float] = []
    now = 0.0
    while waiting or running:
        decodes = [r for r in running if left_prefill[r] == 0]
        tokens = budget - len(decodes)
        prefill_cap = tokens if not decodes or max_prefill_in_mixed is None \
            else min(tokens, max_prefill_in_mixed)
        chunks: dict[int, int] = {}
        for r in [r for r in running if left_prefill[r] > 0]:
            if prefill_cap <= 0:
                break
            chunks[r] = min(left_prefill[r], prefill_cap)
            prefill_cap -= chunks[r]
        while waiting and prefill_cap > 0 and len(running) < max_num_seqs:
            r = waiting.pop(0)
            running.append(r)
            chunks[r] = min(left_prefill[r], prefill_cap)
            prefill_cap -= chunks[r]
        now += costs.step_ms(len(decodes), sum(chunks.values()))
        emitting = decodes + [r for r, n in chunks.items() if n == left_prefill[r]]
        for r, n in chunks.items():
            left_prefill[r] -= n
        for r in emitting:
            previous = last_token[r]
            if previous is not None:
                itls.append(now - previous)
            last_token[r] = now
            left_out[r] -= 1
            if left_out[r] == 0:
                running.remove(r)
    return itls, now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="16384,4096,2048",
                        help="comma-separated max_num_batched_tokens values")
    parser.add_argument("--max-prefill-in-mixed", type=int, default=None,
                        help="bound on the prefill tokens of a step that carries decodes")
    args = parser.parse_args()
    prompts, out_lens = recipe(256, 100, 1024, 151936)
    prompt_lens = [len(p) for p in prompts]
    costs = StepCosts()
    print(f"{costs}; offline elapsed on the H100: 7.84 s (16384), 8.72 s (4096)")
    print("| budget | model total s | ITL p50 ms | ITL p99 ms | p99/p50 | "
          "ITLs > 2x p50 (%) |\n|---|---|---|---|---|---|")
    for budget in (int(b) for b in args.budgets.split(",")):
        itls, total = simulate(prompt_lens, out_lens, budget, 256, costs,
                               args.max_prefill_in_mixed)
        p50, p99 = percentile(itls, 50), percentile(itls, 99)
        long = sum(x > 2 * p50 for x in itls) / max(len(itls), 1) * 100
        print(f"| {budget} | {total / 1e3:.2f} | {p50:.1f} | {p99:.1f} | "
              f"{p99 / p50 if p50 else math.nan:.2f} | {long:.2f} |")


if __name__ == "__main__":
    main()
