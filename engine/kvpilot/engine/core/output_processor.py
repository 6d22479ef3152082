"""Turns sampled tokens into sequence state (logprobs, stops) and the core's output deltas."""

from __future__ import annotations

from kvpilot.engine.contracts.outputs import Logprob, TokenLogprobs
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.core.detokenizer import append_text, check_stop_token, decode_new_text
from kvpilot.engine.core.outputs import CompletionDelta, EngineCoreOutput
from kvpilot.engine.core.request import Request, Sequence


class OutputProcessor:
    """Appends tokens to sequences, applies the stop conditions, and builds each request's
    delta (`EngineCoreOutput`): what it gained since its last one."""

    def __init__(self, tokenizer: TokenizerLike, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    @staticmethod
    def token_logprobs(token: int, logprob: float, rank: int, top_ids: list[int],
                       top_lps: list[float]) -> TokenLogprobs:
        """Gives the {token id: Logprob} map of one position: the chosen token and alternatives.

        Their text (`decoded_token`) is left empty: whoever decodes the output fills it in.
        """
        out: TokenLogprobs = {}
        for r, (tid, lp) in enumerate(zip(top_ids, top_lps, strict=True), start=1):
            out[tid] = Logprob(lp, r)
        if token not in out:
            out[token] = Logprob(logprob, rank)
        return out

    def append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None,
                     logprob: float | None = None) -> None:
        """Adds one sampled token to `seq` and applies the stop conditions.

        Only a request with stop strings has its text decoded here (it must stop on
        the token that completes one); everyone else's text is decoded by the API
        server from the deltas.
        """
        params = seq.request.params
        seq.token_ids.append(token)
        if logprob is not None:
            seq.cumulative_logprob += logprob
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        check_stop_token(seq, params, self.eos_token_ids, self.max_model_len)
        if not params.stop or seq.finish_reason == "stop":
            return  # an eos or stop token's own text is never part of the output (as in vLLM)
        new_text = decode_new_text(self.tokenizer, seq, params.skip_special_tokens)
        reason = seq.finish_reason
        seq.finish_reason = None
        append_text(seq, new_text, params)
        seq.finish_reason = seq.finish_reason or reason

    def build(self, request: Request) -> EngineCoreOutput:
        """Gives what `request` gained since its last output; a beam search's final beams whole
        (they are output once, when it finishes, best first)."""
        params = request.params
        want_lp = params.logprobs is not None
        beams = request.is_beam_search
        seqs = request.seqs
        if beams:
            seqs = sorted(seqs, key=lambda s: -beam_score(s, params.length_penalty))
        num_prompt = request.num_prompt_tokens
        completions: list[CompletionDelta] = []
        for i, seq in enumerate(seqs):
            sent = 0 if beams else seq.num_sent_tokens
            total = len(seq.token_ids) - num_prompt
            finish = seq.finish_reason
            if total == sent and (finish is None or seq.finish_sent):
                continue  # nothing new (a sibling of n > 1 progressed)
            seq.num_sent_tokens = total
            delta = CompletionDelta(i if beams else seq.index, seq.token_ids[num_prompt + sent:])
            if finish is not None:
                seq.finish_sent = True
                delta.finish_reason, delta.stop_reason = finish, seq.stop_reason
            if want_lp or beams:
                delta.cumulative_logprob = seq.cumulative_logprob
            if want_lp:
                delta.logprobs = seq.logprobs[sent:]
            completions.append(delta)
        if not beams and len(completions) > 1:
            completions.sort(key=lambda c: c.index)
        first, finished = not request.first_output_sent, request.finished
        request.first_output_sent = True
        return EngineCoreOutput(
            request.request_id, completions, finished, request.num_cached_tokens,
            metrics=request.metrics if first or finished else None,
            prompt_logprobs=request.prompt_logprobs if first else None,
            error=request.error)


def beam_score(seq: Sequence, length_penalty: float) -> float:
    """Gives a beam's score: cumulative logprob over output length ** length_penalty (as HF)."""
    length = max(seq.num_output_tokens, 1)
    return seq.cumulative_logprob / (length ** length_penalty)
