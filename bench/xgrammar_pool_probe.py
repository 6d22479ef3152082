"""Issue 44 item 4 probe: what xgrammar's batch fill costs before any row's work.

xgrammar 0.2.9's `BatchGrammarMatcher.batch_fill_next_token_bitmask` builds a new thread pool
of `max_threads` threads on every call and joins it (`thread_pool_.emplace(max_threads_)` in
its cpp/grammar_matcher.cc), so each step's mask fill starts that many OS threads. This
times one trivial row (a JSON grammar over a 1,000-token vocabulary: the row's own work is
~1 us) per `max_threads`, and for scale a Python thread's start and join. On a host where
starting a thread is dear (a sandboxed kernel), this is the fill's floor at that thread
count. Prints one JSON line.

    python bench/xgrammar_pool_probe.py [--threads 1,2,4,8,15]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import threading
import time

import xgrammar


def median_us(call, repeat: int = 300) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2,4,8,15")
    args = parser.parse_args()
    info = xgrammar.TokenizerInfo([f"t{i}" for i in range(1000)])
    compiled = xgrammar.GrammarCompiler(info).compile_builtin_json_grammar()
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, 1000)
    out = {"cpus": len(os.sched_getaffinity(0)), "hardware_threads": os.cpu_count()}
    for n in (int(t) for t in args.threads.split(",")):
        fill = xgrammar.BatchGrammarMatcher(max_threads=n).batch_fill_next_token_bitmask
        out[f"one_row_us_max_threads_{n}"] = median_us(functools.partial(fill, [matcher], mask,
                                                                          [0]))
    out["python_thread_start_join_us"] = median_us(
        lambda: (t := threading.Thread(target=int), t.start(), t.join()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
