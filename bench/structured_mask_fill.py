"""Issue 24: what the grammar's token mask costs the host per decode step at batch 64.

Walks `batch` llguidance matchers of one JSON schema (copies of one compiled
grammar, as the engine makes them) through random allowed tokens, a finished
one replaced at once, each first advanced by a random number of tokens so the
rows are at different places of their objects (as in a running batch, where a
string's first tokens cost ms and punctuation us), and times each step's mask
fill one of three ways, in turn: one row after another on this thread (wall
and CPU time), llguidance's parallel executor with its default thread count,
and with 4 threads. One fill per step: a second fill of the same states finds
llguidance's caches warm. Tells whether the parallel fill scales on this host,
and how much of a step the mask alone needs (means count the costly steps).
"""

from __future__ import annotations

import os
import statistics
import time

import llguidance
import llguidance.torch
import numpy as np
import torch


def _summary(name: str, values: list[float]) -> dict[str, float]:
    return {f"{name}_ms_median": round(statistics.median(values) * 1e3, 3),
            f"{name}_ms_mean": round(statistics.mean(values) * 1e3, 3)}


def mask_fill_costs(tokenizer_json: str, vocab_size: int, eos: list[int], grammar: str,
                    batch: int, steps: int, warm_tokens: int = 100, seed: int = 0) -> dict:
    """Gives the median and mean ms per step of each way to fill `batch` rows, and the host's
    CPUs."""
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    template = llguidance.LLMatcher(tok, grammar, log_level=0)
    if template.is_error():
        raise ValueError(template.get_error())
    matchers = [template.deep_copy() for _ in range(batch)]
    executors = {"parallel_default": llguidance.LLExecutor(), "parallel_4": llguidance.LLExecutor(4)}
    shape = llguidance.torch.get_bitmask_shape(batch, vocab_size)
    mask = torch.full(shape, -1, dtype=torch.int32)
    rng = np.random.default_rng(seed)
    times: dict[str, list[float]] = {"serial": [], "serial_cpu": [], **{k: [] for k in executors}}

    def serial() -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        for row, matcher in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(matcher, mask, row)
        times["serial"].append(time.perf_counter() - wall)
        times["serial_cpu"].append(time.process_time() - cpu)

    def parallel(name: str) -> None:
        wall = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(
            executors[name], list(zip(matchers, range(batch), strict=True)), mask)
        times[name].append(time.perf_counter() - wall)

    finished = 0

    def advance(rows: list[int]) -> None:
        nonlocal finished
        bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little").reshape(batch, -1)
        for row in rows:
            matcher = matchers[row]
            token = int(rng.choice(np.flatnonzero(bits[row, :vocab_size])))
            if not matcher.consume_token(token):
                raise RuntimeError(f"matcher refused its own allowed token: {matcher.get_error()}")
            if matcher.is_stopped():
                matchers[row] = template.deep_copy()
                finished += 1

    lead = rng.integers(0, warm_tokens, batch) if warm_tokens else np.zeros(batch, dtype=int)
    for step in range(int(lead.max(initial=0))):  # untimed: spread the rows over the object
        rows = [row for row in range(batch) if lead[row] > step]
        for row in rows:
            llguidance.torch.fill_next_token_bitmask(matchers[row], mask, row)
        advance(rows)
    finished = 0
    for step in range(steps):
        if step % 3 == 0:
            serial()
        else:
            parallel("parallel_default" if step % 3 == 1 else "parallel_4")
        advance(list(range(batch)))
    out: dict = {"batch": batch, "steps": steps, "outputs_finished": finished,
                 "cpus": len(os.sched_getaffinity(0))}
    for name, values in times.items():
        out.update(_summary(name, values))
    return out
