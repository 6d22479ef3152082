"""Streams a router can move to another engine: token-id marks, and a resumed stream's past.

With the router's `x-kvpilot-resumable: 1` on a stream of one completion, each event that
carries output tokens starts with an SSE comment line naming them (`: token_ids 5 17 9`):
the router records them, strips the line, and, should this engine fail, stall or drain,
sends another engine the same request with `resume` holding them. That engine replays
them (`RequestState.resume` here, `core.resume` in the core) and its stream goes on where
this one stopped, without the opening event the client already has. A draining server
ends such streams after `--drain-handover-timeout` with a 503 event (the router resumes
them elsewhere) instead of holding the pod for their whole length.
"""

from __future__ import annotations

from fastapi import Request

from kvpilot.engine.contracts.outputs import RequestOutput
from kvpilot.engine.contracts.router_args import RESUMABLE_HEADER, TOKEN_IDS_MARK
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.engine_loop.request_state import RequestState

_MARK = TOKEN_IDS_MARK.decode()


def marks_token_ids(raw: Request, stream: bool, completions: int) -> bool:
    """Whether the stream's events carry token-id marks: the router asked, and it streams
    one completion."""
    return stream and completions == 1 and raw.headers.get(RESUMABLE_HEADER) == "1"


def token_ids_mark(output: RequestOutput) -> str:
    """Gives the comment line naming `output`'s new token ids ("" when it has none)."""
    ids = [t for c in output.outputs for t in c.token_ids]
    return f"{_MARK} {' '.join(map(str, ids))}\n" if ids else ""


def resumed_output(prompt_token_ids: list[int], params: SamplingParams,
                   tokenizer: TokenizerLike) -> RequestOutput | None:
    """Gives what a resumed stream's client already has (its tokens and their text), None
    for a stream that starts here."""
    if params.resume_token_ids is None:
        return None
    state = RequestState("resumed", None, prompt_token_ids, params, tokenizer, stream=True)
    return state.resume(params.resume_token_ids)
