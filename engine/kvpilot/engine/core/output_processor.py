"""Turns sampled tokens into sequence state (text, logprobs, stop) and RequestOutputs."""

from __future__ import annotations

from kvpilot.engine.contracts.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.core.detokenizer import (
    append_text,
    check_stop_token,
    decode_new_text,
    visible_text,
)
from kvpilot.engine.core.request import Request, Sequence


class OutputProcessor:
    """Appends tokens to sequences and builds the cumulative outputs the engine returns."""

    def __init__(self, tokenizer: TokenizerLike, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def token_logprobs(self, token: int, logprob: float, rank: int, top_ids: list[int],
                       top_lps: list[float]) -> TokenLogprobs:
        """Gives the {token id: Logprob} map of one position: the chosen token and alternatives."""
        out: TokenLogprobs = {}
        for r, (tid, lp) in enumerate(zip(top_ids, top_lps, strict=True), start=1):
            out[tid] = Logprob(lp, r, self.tokenizer.decode([tid]))
        if token not in out:
            out[token] = Logprob(logprob, rank, self.tokenizer.decode([token]))
        return out

    def append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None,
                     logprob: float | None = None, decode: bool = True) -> None:
        """Adds one sampled token to `seq`, decodes its text and applies the stop conditions.

        With `decode` False and no stop strings, text is decoded once when the
        sequence finishes instead of token by token (offline use).
        """
        params = seq.request.params
        seq.token_ids.append(token)
        if logprob is not None:
            seq.cumulative_logprob += logprob
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        check_stop_token(seq, params, self.eos_token_ids, self.max_model_len)
        if seq.finish_reason == "stop":
            # an eos or stop token's own text is never part of the output (as in vLLM)
            if not decode and not params.stop:
                seq.output_text = self.decode(seq, seq.token_ids[seq.num_prompt_tokens:-1])
            return
        if not decode and not params.stop:
            if seq.finish_reason is not None:
                seq.output_text = self.decode(seq, seq.output_token_ids)
            return
        new_text = decode_new_text(self.tokenizer, seq, params.skip_special_tokens)
        reason = seq.finish_reason
        seq.finish_reason = None
        append_text(seq, new_text, params)
        seq.finish_reason = seq.finish_reason or reason

    def decode(self, seq: Sequence, token_ids: list[int]) -> str:
        """Gives the text of `token_ids` under `seq`'s skip_special_tokens setting."""
        return self.tokenizer.decode(token_ids,
                                     skip_special_tokens=seq.request.params.skip_special_tokens)

    def build(self, request: Request) -> RequestOutput:
        """Gives the request's cumulative output now."""
        params = request.params
        want_lp = params.logprobs is not None
        seqs = request.seqs
        if request.is_beam_search:
            seqs = sorted(seqs, key=lambda s: -beam_score(s, params.length_penalty))
        completions = []
        for i, seq in enumerate(seqs):
            text = (self.decode(seq, seq.output_token_ids) if request.is_beam_search
                    else visible_text(seq, params))
            completions.append(CompletionOutput(
                index=i if request.is_beam_search else seq.index,
                text=text,
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob
                if want_lp or request.is_beam_search else None,
                logprobs=list(seq.logprobs) if want_lp else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
        if not request.is_beam_search:
            completions.sort(key=lambda c: c.index)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.finished,
            num_cached_tokens=request.num_cached_tokens,
            metrics=request.metrics,
            prompt_logprobs=list(request.prompt_logprobs)
            if request.prompt_logprobs is not None else None,
            error=request.error,
        )


def beam_score(seq: Sequence, length_penalty: float) -> float:
    """Gives a beam's score: cumulative logprob over output length ** length_penalty (as HF)."""
    length = max(seq.num_output_tokens, 1)
    return seq.cumulative_logprob / (length ** length_penalty)
