"""What the engine core gives back each step: per request, only what is new (deltas).

The core sends these to the API server process once per step (msgspec, see
`kvpilot.engine.core_process`), so they are msgspec Structs encoded as arrays:
one step of 256 decoding requests is one message of a few kilobytes. Text is
not part of them: the API server (or the offline `LLM`) decodes it
(`kvpilot.engine.engine_loop.request_state`). `gc=False`: they hold no reference cycles,
and thousands are made per second, so the cyclic GC need not track them.
"""

from __future__ import annotations

import msgspec

from kvpilot.engine.contracts.outputs import RequestMetrics, TokenLogprobs


class CompletionDelta(msgspec.Struct, array_like=True, gc=False):
    """What one of a request's `n` completions (or beams) gained since its last delta."""

    index: int
    token_ids: list[int]  # new since the last delta (a beam's final delta: all of them)
    finish_reason: str | None = None  # set in the delta that ends the completion
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    cumulative_logprob: float | None = None  # with logprobs or beam search only
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when logprobs are asked


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """A request's progress in one step: its completions' deltas, and whether it ended."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    metrics: RequestMetrics | None = None  # on a request's first output and on its last
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first output, if asked
    error: str | None = None  # why the engine ended the request with finish reason "error"
