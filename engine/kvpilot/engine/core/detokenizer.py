"""Incremental detokenisation and stop conditions of one sequence.

Text is decoded with vLLM's prefix/read-offset method: each new token is decoded
together with a few tokens before it, and only the text beyond what those tokens
already produced is emitted. That keeps BPE merges and SentencePiece leading
spaces right, and holds back output while it ends in an incomplete multi-byte
character ("\\ufffd") until the rest of its bytes arrive.

Two sides run the text functions on the same tokens: the engine core, for
requests with stop strings only (it must see the text to stop on time), and
the API server (`kvpilot.engine.engine_loop.request_state`), which decodes every
request's text. Both apply them token by token, so they find the same stop.
"""

from __future__ import annotations

from typing import Protocol

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.core.request import Sequence

# tokens of context decoded before the new ones (vLLM uses 5 as well)
CONTEXT_TOKENS = 5


class TextState(Protocol):
    """What the text functions read and write of a sequence (the core's `Sequence`, or the
    API server's record of one completion)."""

    token_ids: list[int]  # the prompt (at least its last CONTEXT_TOKENS), then the output
    prefix_offset: int
    read_offset: int
    output_text: str
    finish_reason: str | None
    stop_reason: int | str | None

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...


def init_offsets(seq: TextState) -> None:
    """Points the detokeniser window at the end of the prompt."""
    seq.read_offset = seq.num_prompt_tokens
    seq.prefix_offset = max(seq.read_offset - CONTEXT_TOKENS, 0)


def decode_new_text(tokenizer: TokenizerLike, seq: TextState, skip_special_tokens: bool) -> str:
    """Gives the text the sequence's newest tokens add, or "" while a character is incomplete."""
    ids = seq.token_ids
    prefix_text = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset],
                                   skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return ""
    seq.prefix_offset = seq.read_offset
    seq.read_offset = len(ids)
    return full_text[len(prefix_text):]


def check_stop_token(seq: Sequence, params: SamplingParams, eos_token_ids: list[int],
                     max_model_len: int) -> None:
    """Finishes `seq` on eos, a stop token id, max_tokens or max_model_len (not stop strings)."""
    token_ids = seq.token_ids
    token = token_ids[-1]
    num_output = len(token_ids) - len(seq.request.prompt_token_ids)  # once: runs every token
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            seq.finish_reason = "stop"
            return
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return
    if ((params.max_tokens is not None and num_output >= params.max_tokens)
            or len(token_ids) >= max_model_len):
        seq.finish_reason = "length"


def append_text(seq: TextState, new_text: str, params: SamplingParams) -> None:
    """Adds `new_text` to the output and finishes `seq` when it completes a stop string."""
    seq.output_text += new_text
    if not params.stop or not new_text or seq.num_output_tokens < params.min_tokens:
        return
    longest = max(len(s) for s in params.stop)
    # a stop string may start in earlier text and end in this token's text
    search_from = max(len(seq.output_text) - len(new_text) - longest + 1, 0)
    best: tuple[int, str] | None = None
    for stop in params.stop:
        at = seq.output_text.find(stop, search_from)
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return
    at, stop = best
    end = at + len(stop) if params.include_stop_str_in_output else at
    seq.output_text = seq.output_text[:end]
    seq.finish_reason, seq.stop_reason = "stop", stop


def visible_text(seq: TextState, params: SamplingParams) -> str:
    """Gives the output text safe to show now: a possible stop-string start is held back."""
    if seq.finish_reason is not None or not params.stop:
        return seq.output_text
    hold = max(len(s) for s in params.stop) - 1
    return seq.output_text[:len(seq.output_text) - hold] if hold else seq.output_text
