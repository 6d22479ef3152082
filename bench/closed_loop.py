"""A closed loop over an `LLMEngine` for the batch-64 benchmarks (structured outputs, LoRA).

`batch` requests stay in flight (a finished one is replaced at once) through
`warm_steps` untimed steps and then `timed_steps` timed ones. A step counts as a
decode step when it ran the whole batch, one token each; its time is the wall time
of `step()`, with no device sync between steps: under async scheduling a step
returns once its forward is queued and the previous step booked, so in a steady
run it lasts one GPU step or the host's work, whichever is longer, as in
serving. Output tokens/s is over the timed steps, the device synced at both ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine


@dataclass
class LoopResult:
    decode_step_ms: list[float] = field(default_factory=list)
    other_step_ms: list[float] = field(default_factory=list)  # the timed steps not decode steps
    eager_step_ms: list[float] = field(default_factory=list)  # of those, the eager ones
    tokens: int = 0  # output tokens of the timed steps
    elapsed: float = 0.0  # seconds of the timed steps
    finished_lengths: list[int] = field(default_factory=list)  # output tokens of each ended one

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.elapsed


def closed_loop(engine: LLMEngine, batch: int, warm_steps: int, timed_steps: int,
                add_request: Callable[[], None],
                after_timed_step: Callable[[bool], None] | None = None) -> LoopResult:
    """Runs the loop; `add_request()` adds one request, `after_timed_step(decode)` sees each
    timed step (decode: whether it was a whole-batch decode step)."""
    def sync() -> None:
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize()

    result, start = LoopResult(), 0.0
    produced: dict[str, int] = {}  # output tokens so far per request
    for step in range(warm_steps + timed_steps):
        while len(engine.requests) < batch:
            add_request()
        if step == warm_steps:
            sync()
            start = time.perf_counter()
        began = time.perf_counter()
        tokens = 0
        for out in engine.step():
            count = sum(len(c.token_ids) for c in out.completions)
            tokens += count
            produced[out.request_id] = produced.get(out.request_id, 0) + count
            if out.finished:
                result.finished_lengths.append(produced.pop(out.request_id))
        if step < warm_steps:
            continue
        result.tokens += tokens
        plan = engine._last_plan
        decode = plan is not None and len(plan.scheduled) == batch and \
            all(n == 1 for _, n in plan.scheduled)
        took = (time.perf_counter() - began) * 1e3
        (result.decode_step_ms if decode else result.other_step_ms).append(took)
        if engine._last_mode == "eager":  # a step no graph ran (decode or piecewise)
            result.eager_step_ms.append(took)
        if after_timed_step is not None:
            after_timed_step(decode)
    sync()
    result.elapsed = time.perf_counter() - start
    return result
