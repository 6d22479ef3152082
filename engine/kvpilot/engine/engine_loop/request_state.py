"""One request's outputs as its reader sees them: the core's deltas turned into text.

The API server keeps a `RequestState` per request it sends to the engine core,
and the offline `LLM` one per prompt. `apply` takes an `EngineCoreOutput` (new
token ids per completion) and gives a `RequestOutput`: when streaming, what that
delta adds (new text, token ids, logprobs); otherwise nothing until the request
finishes, and then the whole output.

Text is decoded token by token with `core.detokenizer`: the same steps the core
runs for requests with stop strings, so both sides stop at the same character.
Where nothing needs the text sooner (offline, no stop strings) it is decoded
once at the end, which is cheaper; a beam search's beams are always decoded
whole, since they reach the reader only when they are final.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.engine.contracts.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.core.detokenizer import (
    CONTEXT_TOKENS,
    append_text,
    decode_new_text,
    init_offsets,
    visible_text,
)
from kvpilot.engine.core.outputs import CompletionDelta, EngineCoreOutput


@dataclass(eq=False)
class _Completion:
    """One completion's text state (a `detokenizer.TextState`): the prompt's last tokens,
    then the output's."""

    token_ids: list[int]
    num_prompt_tokens: int
    prefix_offset: int = 0
    read_offset: int = 0
    output_text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None  # all of them; kept when not streaming
    sent_chars: int = 0  # of the visible text, already given in deltas

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class RequestState:
    """Turns one request's `EngineCoreOutput`s into `RequestOutput`s with text."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: TokenizerLike, *, stream: bool,
                 decode_each_token: bool = True) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.stream = stream
        self.decode_each_token = decode_each_token or bool(params.stop)
        self.completions: dict[int, _Completion] = {}
        self.num_cached_tokens = 0
        self.metrics: RequestMetrics | None = None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.error: str | None = None
        self.finished = False

    def apply(self, out: EngineCoreOutput) -> RequestOutput | None:
        """Gives what `out` adds when streaming; otherwise the whole output once `out` ends
        the request, and None before."""
        if out.metrics is not None:
            self.metrics = out.metrics
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
            for entry in out.prompt_logprobs:
                self._name_tokens(entry)
        self.num_cached_tokens = out.num_cached_tokens
        self.error = out.error or self.error
        self.finished = out.finished
        deltas = [self._apply(delta) for delta in out.completions]
        if self.stream:
            return self._output(deltas)
        if not out.finished:
            return None
        return self._output([
            CompletionOutput(index, c.output_text, c.output_token_ids, c.cumulative_logprob,
                             c.logprobs, c.finish_reason, c.stop_reason)
            for index, c in sorted(self.completions.items())])

    def resume(self, token_ids: list[int]) -> RequestOutput:
        """Takes the output tokens another engine already streamed (a migrated request's
        `resume_token_ids`) as completion 0's own, decoded as their deltas were, so the
        deltas that follow continue after them; gives them as one output (what the client
        has: their text, less any held back)."""
        return self._output([self._apply(CompletionDelta(0, list(token_ids)))])

    def _output(self, completions: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             self.finished, self.num_cached_tokens, self.metrics,
                             self.prompt_logprobs, self.error)

    def _apply(self, delta: CompletionDelta) -> CompletionOutput:
        """Adds one completion's delta; gives what it adds (text, tokens, logprobs)."""
        params = self.params
        c = self.completions.get(delta.index)
        if c is None:
            tail = self.prompt_token_ids[-CONTEXT_TOKENS:]
            c = self.completions[delta.index] = _Completion(list(tail), len(tail))
            init_offsets(c)
        if delta.logprobs is not None:
            for entry in delta.logprobs:
                self._name_tokens(entry)
            if not self.stream:
                c.logprobs = (c.logprobs or []) + delta.logprobs
        # an eos or stop token ends the output without its text (as in vLLM)
        token_stop = delta.finish_reason == "stop" and not isinstance(delta.stop_reason, str)
        if params.beam_width > 1:  # a beam's one delta holds all its tokens
            c.token_ids.extend(delta.token_ids)
            c.output_text = self._decode(delta.token_ids)
        elif self.decode_each_token:
            last = len(delta.token_ids) - 1
            for i, token in enumerate(delta.token_ids):
                c.token_ids.append(token)
                if i == last and token_stop:
                    break
                append_text(c, decode_new_text(self.tokenizer, c, params.skip_special_tokens),
                            params)
        else:
            c.token_ids.extend(delta.token_ids)
            if delta.finish_reason is not None:
                ids = c.output_token_ids
                c.output_text = self._decode(ids[:-1] if token_stop else ids)
        # the core decides the finish; the text steps above found the same stop string
        c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.cumulative_logprob is not None:
            c.cumulative_logprob = delta.cumulative_logprob
        text = visible_text(c, params)
        new_text, c.sent_chars = text[c.sent_chars:], len(text)
        return CompletionOutput(delta.index, new_text, delta.token_ids, c.cumulative_logprob,
                                delta.logprobs, c.finish_reason, c.stop_reason)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids,
                                     skip_special_tokens=self.params.skip_special_tokens)

    def _name_tokens(self, entry: TokenLogprobs | None) -> None:
        """Fills in the text of each token of one position's logprobs."""
        for token_id, logprob in (entry or {}).items():
            logprob.decoded_token = self.tokenizer.decode([token_id])


def merge_deltas(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Gives one delta holding `old`'s additions then `new`'s (for a reader that fell behind)."""
    merged = {c.index: c for c in old.outputs}
    for c in new.outputs:
        before = merged.get(c.index)
        if before is None:
            merged[c.index] = c
            continue
        before.text += c.text
        before.token_ids = [*before.token_ids, *c.token_ids]
        if c.logprobs is not None:
            before.logprobs = [*(before.logprobs or []), *c.logprobs]
        before.cumulative_logprob = c.cumulative_logprob
        before.finish_reason, before.stop_reason = c.finish_reason, c.stop_reason
    old.outputs = sorted(merged.values(), key=lambda c: c.index)
    old.finished = new.finished
    old.num_cached_tokens = new.num_cached_tokens
    old.metrics = new.metrics or old.metrics
    old.prompt_logprobs = old.prompt_logprobs or new.prompt_logprobs
    old.error = new.error or old.error
    return old
