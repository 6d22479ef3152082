"""A request and its sequences: the token ids, progress and output state the engine tracks.

A request owns one sequence until its prompt is computed; then parallel sampling
(`n > 1`) and beam search fork more sequences that share the prompt's blocks.
The scheduler and the KV-cache manager work on sequences; outputs are per request.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.engine.contracts.outputs import RequestMetrics, TokenLogprobs
from kvpilot.engine.contracts.sampling_params import SamplingParams

if TYPE_CHECKING:  # for the annotation only: the scheduling core runs without torch
    from concurrent.futures import Future

    import llguidance
    import torch
    import xgrammar

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One token stream: the prompt plus one completion, and how much of it sits in the KV cache."""

    request: Request
    token_ids: list[int]
    index: int = 0  # completion index within the request
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, filled lazily
    # output state; the text is decoded here only for requests with stop strings
    output_text: str = ""
    prefix_offset: int = 0  # incremental detokeniser window (vLLM's method)
    read_offset: int = 0
    num_sent_tokens: int = 0  # output tokens already in an EngineCoreOutput (deltas)
    finish_sent: bool = False  # whether an EngineCoreOutput carried the finish reason
    cumulative_logprob: float = 0.0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    beam_candidates: list[tuple[float, int]] | None = None  # (logprob, token) awaiting selection
    generator: torch.Generator | None = None  # of a seeded request's branch
    sched_key: tuple[int, float, int] | None = None  # the scheduler's order, set on first use
    # >= 0 while the last token id is a placeholder for row `inflight_row` of the step in
    # flight (async scheduling); the engine replaces it when it reads that step back
    inflight_row: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens:]

    @property
    def num_pending_tokens(self) -> int:
        """Gives how many tokens still need their K/V computed before the next sample."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_computed_tokens > 0 and self.num_pending_tokens == 1

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self) -> Sequence:
        """Gives a copy of this sequence with a fresh id (its blocks are shared by the manager)."""
        child = Sequence(request=self.request, token_ids=list(self.token_ids), index=self.index,
                         num_computed_tokens=self.num_computed_tokens, status=self.status,
                         block_hashes=list(self.block_hashes), output_text=self.output_text,
                         prefix_offset=self.prefix_offset, read_offset=self.read_offset,
                         cumulative_logprob=self.cumulative_logprob,
                         logprobs=list(self.logprobs))
        self.request.seqs.append(child)
        return child


@dataclass(eq=False)
class Request:
    """One user request: prompt, sampling parameters and its sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics = field(init=False)  # from arrival_time
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache on first admission
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    forked: bool = False  # whether the n / beam branches exist yet
    first_output_sent: bool = False  # whether an EngineCoreOutput of this request went out
    speculate: bool = False  # whether its decodes verify drafts (speculative decoding)
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    # the structured-output matcher (structured/matchers.py): a Future while it compiles,
    # the error message once it failed
    grammar: (Future[llguidance.LLMatcher | xgrammar.GrammarMatcher] | llguidance.LLMatcher
              | xgrammar.GrammarMatcher | str | None) = None
    # its matchers of the vocabulary's parts (structured/vocab_split.py; empty: not split), and
    # the tokens the full matcher took that they have not taken yet
    grammar_parts: Future[list[llguidance.LLMatcher]] | list[llguidance.LLMatcher] = \
        field(default_factory=list)
    grammar_pending: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if not self.seqs:
            self.seqs.append(Sequence(request=self, token_ids=list(self.prompt_token_ids)))
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_beam_search(self) -> bool:
        return self.params.beam_width > 1

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.seqs)

    def live_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if not seq.finished]
