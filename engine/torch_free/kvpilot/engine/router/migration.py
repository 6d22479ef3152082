"""In-flight request migration: a stream whose replica dies, stalls or drains goes on elsewhere.

The router sends a stream of one completion with `x-kvpilot-resumable: 1`; the engine then
starts each event that carries output tokens with a comment line naming them
(`: token_ids 5 17 9`, `server/stream_resume.py`). `StreamRecord` keeps what the client has
been sent (those ids, the stream's id and `created`, whether `data: [DONE]` came) and strips
the lines. When the stream breaks before `[DONE]` (the connection fails or closes, the
engine sends a 5xx error event, or the replica is found stalled), the router sends another
replica the same body with `resume: {"token_ids": [...], "created": ...}` under the same
response id (`x-kvpilot-request-id`): that engine replays the tokens (stop strings, grammar,
min/max_tokens, seeded sampling keyed by position) and streams what follows, so the client
reads one stream, with no token twice or missing and usage counted once.

What does not move (the stream ends with the error it gets today, saying why): a stream of
several completions (`n` or `best_of` > 1, several prompts), a stream that already moved
`--max-migrations` times, one no other replica took within `--hold-timeout` of the break or
within its tries (`router.tries`), and one whose continuation the new replica refuses (4xx). Non-streamed requests are retried whole before their
first byte, as before (`proxy.py`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.contracts.openai_errors import error_object
from kvpilot.engine.contracts.router_args import REQUEST_ID_HEADER, TOKEN_IDS_MARK

MIGRATING_PATHS = ("/v1/completions", "/v1/chat/completions")
_DONE = b"data: [DONE]"
_ERROR = b'data: {"error"'


def not_resumable(path: str, body: dict[str, Any], max_migrations: int) -> str | None:
    """Gives why a streamed request cannot move to another replica mid-way, None when it can."""
    if max_migrations < 1:
        return "--max-migrations=0 turns migration off"
    if path not in MIGRATING_PATHS:
        return f"{path} streams are not migrated"
    for name in ("n", "best_of"):
        value = body.get(name)
        if isinstance(value, int) and value > 1:
            return f"{name}={value}: several completions' states do not move together"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return f"prompt holds {len(prompt)} prompts: several completions do not move together"
    if body.get("resume") is not None:
        return "the request is itself a continuation (resume)"
    return None


@dataclass
class Interruption:
    """Why a stream broke before its end, and when the router saw it."""

    reason: str  # upstream_failed | engine_error | drained | stalled
    message: str
    status: int = 502
    at: float = field(default_factory=time.monotonic)


@dataclass
class StreamRecord:
    """What the client has of one stream: its output token ids, id, `created`, its end."""

    token_ids: list[int] = field(default_factory=list)
    response_id: str | None = None
    created: int | None = None
    done: bool = False  # `data: [DONE]` was relayed

    def take(self, events: bytes) -> tuple[bytes, Interruption | None]:
        """Gives the bytes of whole SSE `events` to relay (token-id lines stripped, ids
        noted) and the interruption a 5xx error event among them makes (that event and what
        follows it are withheld: the stream goes on elsewhere)."""
        if TOKEN_IDS_MARK not in events and _ERROR not in events and _DONE not in events \
                and self.response_id is not None:
            return events, None  # nothing here to note (a usage or role event)
        out: list[bytes] = []
        for event in events.split(b"\n\n")[:-1]:
            if event.startswith(TOKEN_IDS_MARK):
                line, _, event = event.partition(b"\n")
                self.token_ids.extend(int(t) for t in line[len(TOKEN_IDS_MARK):].split())
            if event.startswith(_ERROR):
                broken = _error_interruption(event)
                if broken is not None:
                    return b"".join(out), broken
            elif event.startswith(_DONE):
                self.done = True
            elif self.response_id is None and event.startswith(b"data: {"):
                self._note_identity(event)
            out.append(event + b"\n\n")
        return b"".join(out), None

    def _note_identity(self, event: bytes) -> None:
        try:
            head = json.loads(event[len(b"data: "):])
            self.response_id = str(head["id"])
            self.created = int(head["created"])
        except (ValueError, KeyError, TypeError):
            return

    def continuation(self, body: dict[str, Any], headers: dict[str, str]
                     ) -> tuple[dict[str, Any], dict[str, str]]:
        """Gives the body and headers that resume the stream on another replica: the same
        request plus the tokens sent, under the same id. A disaggregated decode leg's
        `first_token_id` went to the client already: it leads the tokens."""
        token_ids = list(self.token_ids)
        first = body.get("first_token_id")
        if not token_ids and isinstance(first, int):
            token_ids = [first]
        resumed = {k: v for k, v in body.items() if k != "first_token_id"}
        resumed["resume"] = {"token_ids": token_ids, "created": self.created}
        if self.response_id is not None:
            headers = {**headers, REQUEST_ID_HEADER: self.response_id}
        return resumed, headers


def _error_interruption(event: bytes) -> Interruption | None:
    """Gives the interruption an engine's error event makes: a 5xx (the engine failed, or it
    drains and hands the stream over); None for a refusal of the request (passed on)."""
    try:
        error = json.loads(event[len(b"data: "):])["error"]
        status = int(error.get("code") or 500)
        message = str(error.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        return Interruption("engine_error", "an unreadable error event", 502)
    if status < 500:
        return None
    reason = "drained" if "handed this stream over" in message else "engine_error"
    return Interruption(reason, message, status)


def error_event(status: int, message: str) -> bytes:
    """Gives the SSE events that end a stream which could not go on: the error, then
    `[DONE]` (as an engine ends a failed stream)."""
    payload = json.dumps(error_object(status, message, code=status))
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()
