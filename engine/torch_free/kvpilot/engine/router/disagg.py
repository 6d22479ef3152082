"""Disaggregated serving: a prefill instance computes the prompt's KV, a decode instance
pulls it and streams the answer.

1. router -> prefill (HTTP): the request with `max_tokens: 1`, `stream: false`.
   The prefill engine runs the prompt and, when it finishes, pins the prompt's
   KV blocks under a lease named by the response's `id` (engine/roles.py).
2. router -> decode's KV agent (TCP, kv_transfer/protocol.py): PULL that lease
   from the prefill's agent. The decode agent fetches only the blocks its
   prefix cache lacks, imports them, and releases the lease.
3. router -> decode (HTTP): the original request. Its prompt now hits the
   decode engine's prefix cache, the partial last block included (a prefill engine
   caches it under its tail hash); only the prompt's last token is computed, and
   the answer streams back through the router.

Nothing here is fatal to the request: a prefill that fails on every tried
instance, or a transfer that fails, leaves the decode instance to prefill
locally (counted as `prefill_fallback` / `transfer_fallback`).

The first token comes from the prefill (`FirstToken`): for a streamed request
whose first token's text is final once sampled, the prefill asks for its token
id (`return_token_ids`), the router streams that token to the client at once and
sends the decode instance `first_token_id`, so the decode emits the same token
(whatever the sampling parameters) and continues from it; the router strips the
token's text, already sent, from the decode's stream. The client's time to first
token is then the prefill's, not prefill + transfer + the decode's first step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvpilot.engine.contracts.openai_errors import encode_body
from kvpilot.engine.router.fleet import Instance
from kvpilot.engine.router.proxy import RETRY_STATUSES, NoInstance
from kvpilot.engine.router.stall import Stalled, until_stalled

log = logging.getLogger("kvpilot.router")


def prefill_body(body: dict[str, Any], token_ids: bool = False) -> dict[str, Any]:
    """Gives the body sent to the prefill instance: one token, one choice, no stream; with
    `token_ids`, asking for the token's id."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    out.update({"max_tokens": 1, "stream": False, "n": 1})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if token_ids:
        out["return_token_ids"] = True
    return out


# fields with which the first token's text is not final once sampled (stop strings hold text
# back, logprobs and tools change the chunks), or which one given token cannot serve
_FIRST_TOKEN_BLOCKERS = ("stop", "logprobs", "top_logprobs", "echo", "suffix", "tools",
                         "response_format", "structured_outputs", "guided_json", "guided_regex",
                         "guided_choice", "guided_grammar", "return_token_ids", "first_token_id",
                         "min_tokens", "best_of")


def early_first_token(body: dict[str, Any]) -> bool:
    """Whether the prefill's token may reach the client first (`FirstToken`): a stream of one
    choice and more than one token, with none of the blocking fields set."""
    if body.get("stream") is not True or body.get("n") not in (None, 1):
        return False
    if any(body.get(k) in (1, "1") for k in ("max_tokens", "max_completion_tokens")):
        return False  # the prefill's token is the whole answer: the usual path says so
    return all(_unset(body.get(k)) for k in _FIRST_TOKEN_BLOCKERS)


def _unset(value: Any) -> bool:
    """Whether a body field is off: absent, null, false or empty (0, as in logprobs=0, is on)."""
    return value is None or value is False or value == [] or value == ""


@dataclass
class FirstToken:
    """The prefill's first token, streamed to the client before the decode instance answers."""

    request_id: str  # the prefill's response id: the stream's id, and the decode request's
    token_id: int
    text: str
    chat: bool
    created: int
    model: str

    @classmethod
    def of(cls, reply: Any, chat: bool) -> FirstToken | None:
        """Gives the first token of a prefill's reply; None when it cannot go first: the
        answer ended at it, its text is empty or an unfinished character, or the reply lacks
        the token id (an engine without `return_token_ids`)."""
        try:
            choice = reply["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            ids = choice.get("token_ids")
            if (choice.get("finish_reason") != "length" or not isinstance(text, str) or not text
                    or "\ufffd" in text or not isinstance(ids, list) or len(ids) != 1):
                return None
            return cls(str(reply["id"]), int(ids[0]), text, chat, int(reply["created"]),
                       str(reply["model"]))
        except (KeyError, IndexError, TypeError, ValueError):
            return None

    def _event(self, choice: dict[str, Any]) -> bytes:
        obj = {"id": self.request_id,
               "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice],
               "usage": None}
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def events(self) -> bytes:
        """Gives the stream's opening events, as an engine writes them: chat's empty assistant
        delta, then the token's text."""
        if not self.chat:
            return self._event({"index": 0, "text": self.text, "logprobs": None,
                                "finish_reason": None, "stop_reason": None})
        return b"".join(self._event({"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": None, "stop_reason": None})
                        for delta in ({"role": "assistant", "content": ""},
                                      {"role": None, "content": self.text, "tool_calls": None}))


class SkipSent:
    """Strips the first token's text, which the client has already, from the front of the
    decode instance's stream (whole SSE events in, whole events out)."""

    def __init__(self, first: FirstToken) -> None:
        self.left, self.chat = first.text, first.chat

    def clear(self) -> None:
        """Strips nothing more: the stream moved to an instance resuming after the token."""
        self.left = ""

    def feed(self, data: bytes) -> bytes:
        if not self.left:
            return data
        *events, rest = data.split(b"\n\n")
        return b"".join(self._event(e) for e in events) + rest

    def _event(self, event: bytes) -> bytes:
        whole = event + b"\n\n"
        if not self.left or not event.startswith(b"data: {"):
            return whole
        try:
            obj = json.loads(event[len(b"data: "):])
            choice = obj["choices"][0]
            holder = choice["delta"] if self.chat else choice
            key = "content" if self.chat else "text"
            text = holder.get(key) or ""
        except (ValueError, KeyError, IndexError, TypeError):
            return whole  # no choice (usage) or not ours to read
        n = min(len(text), len(self.left))
        if text[:n] != self.left[:n]:  # cannot happen with the token forced: say so, pass on
            log.warning("decode stream does not start with the first token's text: %r vs %r",
                        text[:20], self.left[:20])
            self.left = ""
            return whole
        self.left, text = self.left[n:], text[n:]
        if self.chat:
            holder["role"] = None  # the opening event named it already
        holder[key] = text or (None if self.chat else "")
        if (not text and choice.get("finish_reason") is None and len(obj["choices"]) == 1
                and not (self.chat and holder.get("tool_calls")) and not obj.get("usage")):
            return b""  # nothing left in it
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def disaggregatable(body: dict[str, Any]) -> bool:
    """Whether one prefill can serve the body (a single prompt; batches prefill locally)."""
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int))


async def run_prefill(client: httpx.AsyncClient, pick: Callable[[set[str]], Awaitable[Instance]],
                      path: str, body: dict[str, Any], headers: dict[str, str],
                      attempts: int, on_result: Callable[..., None], token_ids: bool = False,
                      ) -> tuple[Instance | None, str | None, Any]:
    """Gives (prefill instance, lease id, the reply's JSON); the id is None when no prefill
    succeeded. With `token_ids` the prefill is asked for its token's id."""
    tried: set[str] = set()
    request = prefill_body(body, token_ids)
    for _ in range(attempts):
        try:
            instance = await pick(tried)
        except NoInstance:
            break
        tried.add(instance.url)
        try:
            response = await until_stalled(instance.stall, client.post(
                instance.url + path, content=encode_body(request),
                headers={"content-type": "application/json", **headers}))
        except Stalled:
            log.info("prefill on %s: the instance stalled", instance.url)
            continue  # ejected already
        except (httpx.HTTPError, OSError) as exc:
            log.info("prefill on %s failed: %r", instance.url, exc)
            on_result(instance, False, isinstance(exc, httpx.ConnectError))
            continue
        if response.status_code in RETRY_STATUSES:
            on_result(instance, response.status_code == 429)  # busy is not broken
            continue
        on_result(instance, True)
        if response.status_code >= 400:
            return instance, None, None  # a bad request: the decode instance tells the client
        try:
            reply = response.json()
            lease_id = reply.get("id")
        except (ValueError, AttributeError):
            reply = lease_id = None
        return instance, lease_id if isinstance(lease_id, str) else None, reply
    return None, None, None
