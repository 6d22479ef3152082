"""Issue 24: what the grammar's token mask costs the host per decode step at batch 64.

Walks `batch` llguidance matchers of one JSON schema, each compiled for its row
as the engine does (`structured.matchers.new_matcher`), through random allowed
tokens, a finished one replaced at once, each first advanced by a random number
of tokens so the rows are at different places of their objects (as in a running
batch, where a string's first tokens cost ms and punctuation us). Each step's
fill is timed one of two ways, in turn: one row after another on this thread
(`serial`), and llguidance's parallel executor with the engine's thread count
(`parallel`, wall and CPU time). A second set of rows, deep copies of one
compiled matcher (the engine's way before: copies share one locked lexer),
advanced by the same tokens, is filled in parallel every step
(`parallel_copies`). `serial_max_row` is a serial step's costliest row: the
parallel fill's floor however many threads a host has. One fill per step and set: a matcher keeps its last mask,
so a second fill of the same state costs nothing. Tells whether the parallel
fill scales on this host, and how much of a step the mask needs (the means
count the costly steps; `*_us_per_row` = mean / batch).
"""

from __future__ import annotations

import os
import statistics
import time

import llguidance
import numpy as np

from kvpilot.engine.structured.matchers import fill_threads, new_matcher


def _summary(name: str, values: list[float], batch: int) -> dict[str, float]:
    return {f"{name}_ms_median": round(statistics.median(values) * 1e3, 3),
            f"{name}_ms_mean": round(statistics.mean(values) * 1e3, 3),
            f"{name}_us_per_row": round(statistics.mean(values) * 1e6 / batch, 1)}


def mask_fill_costs(tokenizer_json: str, vocab_size: int, eos: list[int], grammar: str,
                    batch: int, steps: int, warm_tokens: int = 100, seed: int = 0) -> dict:
    """Gives the median and mean ms per step (and mean us per row) of each way to fill `batch`
    rows, the parallel fill's CPU time, its threads, and the host's CPUs."""
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    template = new_matcher(tok, grammar)
    rows = [new_matcher(tok, grammar) for _ in range(batch)]
    copies = [template.deep_copy() for _ in range(batch)]
    threads = fill_threads()
    executor = llguidance.LLExecutor(threads)
    words = (vocab_size + 31) // 32
    mask = np.full((batch, words), -1, dtype=np.int32)
    copies_mask = np.full((batch, words), -1, dtype=np.int32)
    rng = np.random.default_rng(seed)
    times: dict[str, list[float]] = {"serial": [], "serial_max_row": [], "parallel": [],
                                     "parallel_cpu": [], "parallel_copies": []}

    def fill_serial(matchers: list[llguidance.LLMatcher], out: np.ndarray) -> float:
        costliest = 0.0
        for row, matcher in enumerate(matchers):
            began = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(out[row].ctypes.data, words * 4)
            costliest = max(costliest, time.perf_counter() - began)
        return costliest

    def fill_parallel(matchers: list[llguidance.LLMatcher], out: np.ndarray) -> None:
        executor.unsafe_compute_mask_ptr(list(zip(matchers, range(batch), strict=True)),
                                         out.ctypes.data, words * 4, batch)

    finished = 0

    def advance(which: list[int]) -> None:
        nonlocal finished
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little").reshape(batch, -1)
        for row in which:
            token = int(rng.choice(np.flatnonzero(bits[row, :vocab_size])))
            for matcher in (rows[row], copies[row]):
                if not matcher.consume_token(token):
                    raise RuntimeError(f"matcher refused an allowed token: {matcher.get_error()}")
            if rows[row].is_stopped():
                rows[row], copies[row] = new_matcher(tok, grammar), template.deep_copy()
                finished += 1

    lead = rng.integers(0, warm_tokens, batch) if warm_tokens else np.zeros(batch, dtype=int)
    for step in range(int(lead.max(initial=0))):  # untimed: spread the rows over the object
        fill_serial(rows, mask)
        advance([row for row in range(batch) if lead[row] > step])
    finished = 0
    for step in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        if step % 2 == 0:
            times["serial_max_row"].append(fill_serial(rows, mask))
            times["serial"].append(time.perf_counter() - wall)
        else:
            fill_parallel(rows, mask)
            times["parallel"].append(time.perf_counter() - wall)
            times["parallel_cpu"].append(time.process_time() - cpu)
        wall = time.perf_counter()
        fill_parallel(copies, copies_mask)
        times["parallel_copies"].append(time.perf_counter() - wall)
        if not np.array_equal(mask, copies_mask):
            raise RuntimeError("copies and compiled rows disagree on a mask")
        advance(list(range(batch)))
    out: dict = {"batch": batch, "steps": steps, "outputs_finished": finished,
                 "cpus": len(os.sched_getaffinity(0)), "fill_threads": threads}
    for name, values in times.items():
        out.update(_summary(name, values, batch))
    return out
