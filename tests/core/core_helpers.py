"""A model-free stand-in for the engine loop, to drive the scheduler in tests."""

from __future__ import annotations

import itertools

from kvpilot.engine.contracts.outputs import CompletionOutput, RequestOutput
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.outputs import EngineCoreOutput
from kvpilot.engine.core.request import Request, Sequence
from kvpilot.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

_clock = itertools.count()


class Outputs:
    """Folds an engine's deltas into whole outputs per request (token ids, logprobs and
    finish; no text: these tests compare tokens)."""

    def __init__(self) -> None:
        self.by_id: dict[str, RequestOutput] = {}

    def add(self, delta: EngineCoreOutput) -> RequestOutput:
        """Gives the request's whole output so far, with `delta` added."""
        out = self.by_id.setdefault(delta.request_id,
                                    RequestOutput(delta.request_id, None, [], [], False))
        completions = {c.index: c for c in out.outputs}
        for d in delta.completions:
            c = completions.setdefault(d.index, CompletionOutput(d.index, "", []))
            c.token_ids = [*c.token_ids, *d.token_ids]
            if d.logprobs is not None:
                c.logprobs = [*(c.logprobs or []), *d.logprobs]
            if d.cumulative_logprob is not None:
                c.cumulative_logprob = d.cumulative_logprob
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        out.outputs = sorted(completions.values(), key=lambda c: c.index)
        out.finished, out.error = delta.finished, delta.error or out.error
        out.num_cached_tokens = delta.num_cached_tokens
        return out


def run_engine(engine, limit: int = 200, outputs: Outputs | None = None
               ) -> dict[str, RequestOutput]:
    """Steps `engine` until no request is unfinished, at most `limit` steps (more fails the
    test instead of hanging it); gives the finished outputs by request id (folded into
    `outputs`, which may hold deltas of steps run before)."""
    outputs, done = outputs or Outputs(), {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return done
        for delta in engine.step():
            out = outputs.add(delta)
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests(), f"requests still unfinished after {limit} steps"
    return done


def make_request(rid: str, prompt: int | list[int], max_tokens: int = 4, priority: int = 0,
                 arrival: float | None = None) -> Request:
    """Gives a request with a prompt of `prompt` tokens (ids 10, 11, ...) or the given ids."""
    ids = list(range(10, 10 + prompt)) if isinstance(prompt, int) else list(prompt)
    return Request(rid, None, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   float(next(_clock)) if arrival is None else arrival, priority)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, caching: bool = True,
                   **config) -> Scheduler:
    """Gives a scheduler over a fresh KV-cache manager."""
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(**config), kv)


def run_step(scheduler: Scheduler, next_token: int = 7) -> SchedulerOutput:
    """Plans one step and plays it: computes the planned tokens, samples `next_token`."""
    plan = scheduler.schedule()
    for seq, num_new in plan.scheduled:
        seq.num_computed_tokens += num_new
        scheduler.kv.cache_full_blocks(seq)
        if seq.num_pending_tokens == 0:
            seq.token_ids.append(next_token)
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                scheduler.remove(seq)
    return plan


def scheduled_ids(plan: SchedulerOutput) -> list[tuple[str, int]]:
    """Gives (request id, new tokens) of each planned sequence, in batch order."""
    return [(seq.request.request_id, n) for seq, n in plan.scheduled]


def seq_of(request: Request) -> Sequence:
    return request.seqs[0]


# the HF-parity families and the tokens generated per prompt
FAMILIES = ("llama", "qwen3", "mixtral")
NEW_TOKENS = 16
