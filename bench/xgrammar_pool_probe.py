"""Issue 44 item 4 probe: what xgrammar's batch fill costs before any row's work, and
whether per-row fills on a persistent pool of threads do better.

xgrammar 0.2.9's `BatchGrammarMatcher.batch_fill_next_token_bitmask` builds a new thread pool
of `max_threads` threads on every call and joins it (`thread_pool_.emplace(max_threads_)` in
its cpp/grammar_matcher.cc), so each step's mask fill starts that many OS threads. Two parts:

- `floor`: one trivial row (a JSON grammar over a 1,000-token vocabulary: the row's own
  work is ~1 us) per `max_threads`, and for scale a Python thread's start and join. On a
  host where starting a thread is dear (a sandboxed kernel), this is the fill's floor.
- `rows`: 64 matchers of `structured_gpu.SCHEMA` over its synthetic 152k vocabulary walking
  random allowed tokens; each step's 64-row fill timed as the engine's batch call
  (`batch_<n>`) and as `GrammarMatcher.fill_next_token_bitmask` per row, the rows split
  over a persistent `ThreadPoolExecutor` of n threads (`pool_<n>`: it scales only if the
  per-row call drops the GIL), and the 64 rows' `accept_token` one after another on this
  thread (`accept_ms_p50_serial`; the engine called `batch_accept_token`, which also
  starts a pool per call: its floor is `floor`'s). Medians over the walk's steps.

Prints one JSON line.

    python bench/xgrammar_pool_probe.py [--threads 1,2,4,8,15] [--steps 60]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import xgrammar


def median_us(call: Callable[[], object], repeat: int = 300) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def floor(threads: list[int]) -> dict:
    info = xgrammar.TokenizerInfo(["{"] + [f"t{i}" for i in range(1, 1000)])
    compiled = xgrammar.GrammarCompiler(info).compile_builtin_json_grammar()
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, 1000)
    out = {}
    for n in threads:
        fill = xgrammar.BatchGrammarMatcher(max_threads=n).batch_fill_next_token_bitmask
        out[f"one_row_us_max_threads_{n}"] = median_us(functools.partial(fill, [matcher], mask,
                                                                          [0]))
    accept = xgrammar.BatchGrammarMatcher(max_threads=threads[-1]).batch_accept_token
    probe = xgrammar.GrammarMatcher(compiled)
    out[f"one_row_accept_and_rollback_us_max_threads_{threads[-1]}"] = median_us(
        lambda: (accept([probe], [0]), probe.rollback(1)))
    out["python_thread_start_join_us"] = median_us(
        lambda: (t := threading.Thread(target=int), t.start(), t.join()))
    return out


def rows(threads: list[int], steps: int, batch: int = 64, vocab_size: int = 151936) -> dict:
    from structured_gpu import SCHEMA, synthetic_tokenizer
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    started = time.perf_counter()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(
        json.dumps(synthetic_tokenizer(vocab_size))))
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                   stop_token_ids=[vocab_size - 3])
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    setup_s = time.perf_counter() - started
    rng = random.Random(0)
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
    mask = xgrammar.allocate_token_bitmask(batch, vocab_size)
    ids = list(range(batch))
    fills: dict[str, Callable[[], object]] = {}
    pools = []
    for n in threads:
        fills[f"batch_{n}"] = functools.partial(
            xgrammar.BatchGrammarMatcher(max_threads=n).batch_fill_next_token_bitmask,
            matchers, mask, ids)
        pool = ThreadPoolExecutor(n)
        pools.append(pool)
        chunks = [ids[i::n] for i in range(n)]

        def fill_rows(chunk: list[int]) -> None:
            for i in chunk:
                matchers[i].fill_next_token_bitmask(mask, i)

        fills[f"pool_{n}"] = functools.partial(lambda p, c: list(p.map(fill_rows, c)), pool,
                                               chunks)
    times: dict[str, list[float]] = {name: [] for name in fills}
    accepts: list[float] = []
    for _ in range(steps):
        for name, fill in fills.items():
            begun = time.perf_counter()
            fill()
            times[name].append(time.perf_counter() - begun)
        bits = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)
        tokens = [rng.choice(bits[i, :vocab_size].nonzero().flatten().tolist())
                  for i in range(batch)]
        begun = time.perf_counter()
        for matcher, token in zip(matchers, tokens, strict=True):
            matcher.accept_token(token)
        accepts.append(time.perf_counter() - begun)
        for matcher in matchers:
            if matcher.is_terminated():
                matcher.reset()
    for pool in pools:
        pool.shutdown()
    return {"setup_s": round(setup_s, 1), "steps": steps, "rows": batch,
            "accept_ms_p50_serial": round(statistics.median(accepts) * 1e3, 3),
            **{f"fill_ms_p50_{name}": round(statistics.median(ts) * 1e3, 3)
               for name, ts in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--threads", default="1,2,4,8,15")
    parser.add_argument("--steps", type=int, default=60, help="steps of the 64-row walk")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    out = {"cpus": len(os.sched_getaffinity(0)), "hardware_threads": os.cpu_count(),
           **floor(threads), **rows(threads, args.steps)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
