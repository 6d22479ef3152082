"""Issue 44 item 4 probe: what xgrammar's batch fill costs before any row's work, and
whether per-row fills on a persistent pool of threads do better.

xgrammar 0.2.9's `BatchGrammarMatcher.batch_fill_next_token_bitmask` builds a new thread pool
of `max_threads` threads on every call and joins it (`thread_pool_.emplace(max_threads_)` in
its cpp/grammar_matcher.cc), so each step's mask fill starts that many OS threads. Two parts:

- `floor`: one trivial row (a JSON grammar over a 1,000-token vocabulary: the row's own
  work is ~1 us) per `max_threads`, and for scale a Python thread's start and join. On a
  host where starting a thread is dear (a sandboxed kernel), this is the fill's floor.
- `rows`: 64 of the engine's matchers of `structured_gpu.SCHEMA` (`XgrammarMatchers`) over
  its synthetic 152k vocabulary, each first advanced by a random number of random allowed
  tokens, then walking random allowed tokens; each step's 64-row fill timed as xgrammar's
  batch call (`batch_<n>`, the engine's fill), as per-row fills on a pool of n threads
  made once, each taking the next row (`pool_<n>`; it scales because a row's fill drops
  the GIL, but inside the engine each row's return waits for the GIL), one row after another
  (`serial`, with the step's costliest row: the floor of any parallel fill), and the 64
  rows' `accept_token` one after another (`accept_ms_p50_serial`), as xgrammar's batch
  accept with the most threads (the engine's before, `accept_ms_p50_batch_<n>`) and as
  `XgrammarMatchers.accept` (now: a batch accept on one thread, `accept_ms_p50_engine_<n>`).
  Medians over the steps.

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

    from kvpilot.engine.structured.xgrammar_backend import XgrammarMatchers

    started = time.perf_counter()
    tokenizer_json = json.dumps(synthetic_tokenizer(vocab_size))
    engine = XgrammarMatchers(tokenizer_json, vocab_size, [vocab_size - 3], threads[-1])
    # the engine's matchers (its grammar text, its compiler), each row advanced by a random
    # number of random allowed tokens first, so the rows sit at different places of their
    # objects as a running batch's do
    matchers = [engine.matcher(json.dumps(SCHEMA), []) for _ in range(batch)]
    setup_s = time.perf_counter() - started
    rng = random.Random(0)
    mask = xgrammar.allocate_token_bitmask(batch, vocab_size)

    def allowed(i: int) -> list[int]:
        bits = ((mask[i].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
        return bits[:vocab_size].nonzero().flatten().tolist()

    for i, matcher in enumerate(matchers):
        for _ in range(rng.randrange(60)):
            matcher.fill_next_token_bitmask(mask, i)
            matcher.accept_token(rng.choice(allowed(i)))
            if matcher.is_terminated():
                matcher.reset()
    ids = list(range(batch))

    def pooled(pool: ThreadPoolExecutor, n: int) -> None:
        left = iter(range(batch))  # shared: next() on it is atomic under the GIL

        def work() -> None:
            for i in left:
                matchers[i].fill_next_token_bitmask(mask, i)

        helpers = [pool.submit(work) for _ in range(n - 1)]
        work()
        for helper in helpers:
            helper.result()

    fills: dict[str, Callable[[], object]] = {}
    pools = []
    for n in threads:
        fills[f"batch_{n}"] = functools.partial(
            xgrammar.BatchGrammarMatcher(max_threads=n).batch_fill_next_token_bitmask,
            matchers, mask, ids)
        pools.append(ThreadPoolExecutor(max(n - 1, 1)))
        fills[f"pool_{n}"] = functools.partial(pooled, pools[-1], n)
    times: dict[str, list[float]] = {name: [] for name in fills}
    serial: list[float] = []
    costliest: list[float] = []
    accepts: list[float] = []
    accept_times: dict[str, list[float]] = {"batch": [], "engine": []}
    batch_accept = xgrammar.BatchGrammarMatcher(max_threads=threads[-1]).batch_accept_token
    for _ in range(steps):
        for name, fill in fills.items():  # a matcher refills the same state at full cost
            begun = time.perf_counter()
            fill()
            times[name].append(time.perf_counter() - begun)
        per_row = []
        for i, matcher in enumerate(matchers):
            begun = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, i)
            per_row.append(time.perf_counter() - begun)
        serial.append(sum(per_row))
        costliest.append(max(per_row))
        tokens = [rng.choice(allowed(i)) for i in range(batch)]
        for name, accept in (("batch", batch_accept), ("engine", engine.accept)):
            begun = time.perf_counter()
            accept(matchers, tokens)
            accept_times[name].append(time.perf_counter() - begun)
            for matcher in matchers:
                matcher.rollback(1)
        begun = time.perf_counter()
        for matcher, token in zip(matchers, tokens, strict=True):
            matcher.accept_token(token)
        accepts.append(time.perf_counter() - begun)
        for matcher in matchers:
            if matcher.is_terminated():
                matcher.reset()
    for pool in pools:
        pool.shutdown()

    def p50(values: list[float]) -> float:
        return round(statistics.median(values) * 1e3, 3)

    return {"setup_s": round(setup_s, 1), "steps": steps, "rows": batch,
            "accept_ms_p50_serial": p50(accepts),
            **{f"accept_ms_p50_{name}_{threads[-1]}": p50(ts) for name, ts in accept_times.items()},
            "fill_ms_p50_serial": p50(serial),
            "costliest_row_ms_p50": p50(costliest),
            **{f"fill_ms_p50_{name}": p50(ts) for name, ts in times.items()}}


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
