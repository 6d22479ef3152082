"""A chat completions stream turned into the Responses API's events.

response.created, response.in_progress; for the text: response.output_item.added (the
message), response.content_part.added, response.output_text.delta per chunk,
response.output_text.done, response.content_part.done, response.output_item.done; per tool
call (the engine sends each whole when the reply ends): response.output_item.added,
response.function_call_arguments.delta and .done, response.output_item.done; then
response.completed (response.incomplete at max_output_tokens) with the whole Response and
its usage. A chat stream that ends in an error event gives an `error` event and
response.failed. Every event carries `sequence_number`, and is written with its `event:`
line as OpenAI's are.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import AsyncContentStream

from kvpilot.engine.router.responses_api import (
    ResponsesRequest,
    assistant_turn,
    call_item,
    message_item,
    new_id,
    response_object,
)


class ResponseEvents:
    """One streamed response's state: its output so far and the next sequence number."""

    def __init__(self, request: ResponsesRequest, response_id: str,
                 on_done: Callable[[dict[str, Any]], None]) -> None:
        self.request, self.response_id, self.on_done = request, response_id, on_done
        self.created = int(time.time())
        self.sequence = 0
        self.message_id = new_id("msg")
        self.text: str | None = None  # None until the message item opened
        self.output: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    def _response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.request, self.response_id, self.created, status,
                               self.output, self.usage, self.finish_reason, error)

    def opening(self) -> bytes:
        response = self._response("in_progress")
        return (self._event("response.created", response=response)
                + self._event("response.in_progress", response=response))

    def _open_message(self) -> bytes:
        self.text = ""
        item = message_item(self.message_id, "", "in_progress")
        return (self._event("response.output_item.added", output_index=len(self.output),
                            item=item)
                + self._event("response.content_part.added", item_id=self.message_id,
                              output_index=len(self.output), content_index=0,
                              part={"type": "output_text", "text": "", "annotations": []}))

    def _close_message(self) -> bytes:
        if self.text is None:
            return b""
        index, text = len(self.output), self.text
        item = message_item(self.message_id, text)
        self.output.append(item)
        return (self._event("response.output_text.done", item_id=self.message_id,
                            output_index=index, content_index=0, text=text, logprobs=[])
                + self._event("response.content_part.done", item_id=self.message_id,
                              output_index=index, content_index=0, part=item["content"][0])
                + self._event("response.output_item.done", output_index=index, item=item))

    def chunk(self, obj: dict[str, Any]) -> bytes:
        """Gives the events of one chat chunk."""
        out = b""
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.text is None:
                    out += self._open_message()
                self.text = (self.text or "") + delta["content"]
                out += self._event("response.output_text.delta", item_id=self.message_id,
                                   output_index=len(self.output), content_index=0,
                                   delta=delta["content"], logprobs=[])
            for call in delta.get("tool_calls") or []:
                out += self._close_message() + self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _call(self, call: dict[str, Any]) -> bytes:
        self.calls.append(call)
        item = call_item(call)
        index = len(self.output)
        self.output.append(item)
        return (self._event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"})
                + self._event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=index, delta=item["arguments"])
                + self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, arguments=item["arguments"])
                + self._event("response.output_item.done", output_index=index, item=item))

    def ending(self) -> bytes:
        """Gives the closing events, and stores the conversation."""
        empty = self.text is None and not self.calls  # an empty reply is still one message
        out = (self._open_message() if empty else b"") + self._close_message()
        response = self._response("completed")
        self.on_done(assistant_turn(self.text, self.calls))
        kind = "response.incomplete" if response["status"] == "incomplete" \
            else "response.completed"
        return out + self._event(kind, response=response)

    def failure(self, error: dict[str, Any]) -> bytes:
        """Gives the events of a stream that failed: `error`, then response.failed."""
        message = str(error.get("message", "the engine failed"))
        code = error.get("code")
        return (self._event("error", code=None if code is None else str(code), message=message,
                            param=error.get("param"))
                + self._event("response.failed", response=self._response(
                    "failed", {"code": "server_error", "message": message})))


async def response_events(chat: AsyncContentStream, events: ResponseEvents
                          ) -> AsyncIterator[bytes]:
    """Yields the Responses events of a chat completions SSE stream."""
    yield events.opening()
    held = b""
    async for data in chat:
        held += data.encode() if isinstance(data, str) else bytes(data)
        *whole, held = held.split(b"\n\n")
        for event in whole:
            if not event.startswith(b"data: {"):
                continue  # [DONE], comments
            obj = json.loads(event[len(b"data: "):])
            if "error" in obj:
                yield events.failure(obj["error"])
                return
            out = events.chunk(obj)
            if out:
                yield out
    yield events.ending()
