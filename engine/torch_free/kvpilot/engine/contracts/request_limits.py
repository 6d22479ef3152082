"""How large a request an engine's API server or a router takes, and the ASGI guard that
answers 413 before a byte past the limit is read (torch-free).

An engine sizes both limits from its context length unless told otherwise:

- prompt characters (`--max-prompt-chars`): no token covers more characters than the
  vocabulary's longest token string (a byte-level BPE piece has a character per byte, a
  text has at least as many bytes as characters), so a prompt longer than `max_model_len`
  times that cannot fit, whatever its text: refused before it is tokenised;
- body bytes (`--max-request-bytes`): such a prompt written as JSON escapes (six bytes a
  character at most), or `max_model_len` token ids, plus 1 MiB for the other fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.engine.contracts.openai_errors import error_object

BYTES_PER_CHAR = 6  # "\\u1234": the longest a character of a JSON string gets
BYTES_PER_TOKEN_ID = 12  # "2147483647, "
OTHER_FIELDS_BYTES = 1 << 20  # sampling fields, tools, a JSON schema


@dataclass(frozen=True)
class RequestLimits:
    """The largest request body and prompt a server takes."""

    max_request_bytes: int
    max_prompt_chars: int

    @classmethod
    def for_model(cls, max_model_len: int, token_chars: int, max_request_bytes: int = 0,
                  max_prompt_chars: int = 0) -> RequestLimits:
        """Gives the limits of a model of `max_model_len` tokens whose longest token covers
        `token_chars` characters; a nonzero argument (the flag) wins over its default."""
        chars = max_prompt_chars or max_model_len * token_chars
        body = max_request_bytes or (max(chars * BYTES_PER_CHAR,
                                         max_model_len * BYTES_PER_TOKEN_ID)
                                     + OTHER_FIELDS_BYTES)
        return cls(body, chars)


class BodyLimit:
    """ASGI middleware: a POST body over `max_bytes` gets a 413 in OpenAI's error shape,
    from its Content-Length before any of it is read, else as soon as the count passes it;
    the app reads the buffered body as usual (and the connection's later messages, such as
    a disconnect, as they come)."""

    def __init__(self, app: ASGIApp, max_bytes: int, flag: str = "--max-request-bytes") -> None:
        self.app, self.max_bytes, self.flag = app, max_bytes, flag

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(f"has {int(declared)} bytes", scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to answer
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                await self._refuse(f"has more than {self.max_bytes} bytes", scope, receive, send)
                return
        first: Message | None = {"type": "http.request", "body": b"".join(chunks),
                                 "more_body": False}

        async def replay() -> Message:
            nonlocal first
            if first is None:
                return await receive()
            message, first = first, None
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, size: str, scope: Scope, receive: Receive, send: Send) -> None:
        message = (f"the request body {size}: this server takes at most {self.max_bytes} "
                   f"({self.flag}); send a shorter prompt or fewer prompts at once")
        response = JSONResponse(error_object(413, message), 413,
                                headers={"connection": "close"})
        await response(scope, receive, send)
