"""POST /v1/chat/completions: the chat rendered through the tokenizer's template, then generated."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request

from kvpilot.engine.contracts.outputs import CompletionOutput, RequestOutput
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.core_process.client import OutputStream
from kvpilot.engine.server.chat_tools import ToolReply
from kvpilot.engine.server.params import chat_prompt, prompt_chars, sampling_params
from kvpilot.engine.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    TopLogprob,
)
from kvpilot.engine.server.serving import (
    GenerationStream,
    ServingContext,
    StreamUsage,
    admit_requests,
    cancel_on_disconnect,
    check_error,
    given_request_id,
    merge,
    ranked,
    sse,
    sse_error,
    token_logprobs,
    token_text,
    usage_of,
)
from kvpilot.engine.server.sse_chunks import ChatChunks
from kvpilot.engine.server.stream_resume import marks_token_ids, resumed_output, token_ids_mark


def chat_logprobs(tokenizer: TokenizerLike, completion: CompletionOutput, k: int) -> ChatLogprobs:
    """Gives chat-style logprobs for the tokens of `completion`."""
    content = []
    for tid, entry in token_logprobs(completion):
        text = token_text(tokenizer, tid, entry)
        alternatives = [
            TopLogprob(token=(t := token_text(tokenizer, alt, entry)), logprob=lp,
                       bytes=list(t.encode()))
            for alt, lp in (ranked(entry, k) if entry else [])]
        content.append(ChatTokenLogprob(
            token=text, bytes=list(text.encode()),
            logprob=entry[tid].logprob if entry and tid in entry else float("-inf"),
            top_logprobs=alternatives))
    return ChatLogprobs(content=content)


async def create_chat_completion(request: ChatCompletionRequest, raw: Request,
                                 ctx: ServingContext, lora_name: str | None = None
                                 ) -> ChatCompletionResponse | GenerationStream:
    """Gives the assistant's reply (n choices; with LoRA adapter `lora_name`), or a stream
    of chunks when `stream` is set."""
    arrival = time.monotonic()
    # rendering and tokenising in a worker thread keeps the loop serving (a long chat)
    prompt = await ctx.tokenising(prompt_chars(request, ctx.limits), chat_prompt, request,
                                  ctx.tokenizer, ctx.limits)
    tools = ToolReply.of(request, ctx.tool_call_parser)
    # off the loop too: a JSON schema's grammar is compiled to be checked
    params = await ctx.off_loop(sampling_params, request, len(prompt), ctx.limits)
    request_id, streams = await admit_requests(ctx, "chatcmpl", [prompt], [params], arrival,
                                               request.priority, request.stream, lora_name,
                                               given_request_id(raw))
    if request.stream:
        marked = marks_token_ids(raw, True, request.n)
        body = _stream(request, ctx, request_id, streams, len(prompt), tools, marked,
                       resumed_output(prompt, params, ctx.tokenizer))
        return GenerationStream(body, ctx.gate, streams, ctx.resumable if marked else None,
                                request_id)
    try:
        final = await cancel_on_disconnect(raw, _last(streams[0]))
    finally:
        ctx.gate.release()
    check_error(final)
    k = request.top_logprobs or 0
    choices = []
    for c in final.outputs:
        message, reason = ChatResponseMessage(content=c.text), c.finish_reason
        if tools is not None:
            parsed = tools.parse(c.text)
            message = ChatResponseMessage(content=parsed.content, tool_calls=parsed.tool_calls)
            reason = tools.finish_reason(parsed, reason)
        choices.append(ChatChoice(
            index=c.index, message=message,
            logprobs=chat_logprobs(ctx.tokenizer, c, k) if request.logprobs else None,
            finish_reason=reason, stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if request.return_token_ids else None))
    return ChatCompletionResponse(id=request_id, model=request.model, choices=choices,
                                  usage=usage_of([final], [len(prompt)]))


def _delta(tools: ToolReply | None, c: CompletionOutput) -> ChatDelta:
    """Gives one streamed choice's delta: its text, or with tools the content that can go
    out now and, when the choice ends, its calls."""
    if tools is None:
        return ChatDelta(content=c.text or None)
    content = tools.feed(c.index, c.text)
    if c.finish_reason is None:
        return ChatDelta(content=content or None)
    rest, calls = tools.finish(c.index)
    return ChatDelta(content=(content + (rest or "")) or None, tool_calls=calls or None)


def _finish_reason(tools: ToolReply | None, c: CompletionOutput) -> str | None:
    """Gives "tool_calls" for a free reply that ended in calls (read after `_delta`)."""
    if tools is None or c.finish_reason != "stop" or tools.named is not None:
        return c.finish_reason
    return "tool_calls" if tools.ended_in_calls.get(c.index) else c.finish_reason


async def _last(stream: OutputStream) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    assert last is not None, "an engine stream ends with a finished output"
    return last


async def _stream(request: ChatCompletionRequest, ctx: ServingContext, request_id: str,
                  streams: list[OutputStream], prompt_len: int, tools: ToolReply | None,
                  marked: bool, resumed: RequestOutput | None
                  ) -> AsyncGenerator[str | bytes, None]:
    """Gives the SSE events of the reply; `marked`, each token event begins with its token
    ids (`stream_resume`); `resumed`, the stream continues one another engine began."""
    created = request.resume.created if request.resume and request.resume.created \
        else int(time.time())
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    k = request.top_logprobs or 0

    def chunk(choices: list[ChatStreamChoice]) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=request.model,
                                       choices=choices))

    # OpenAI opens every choice with an empty assistant delta. It leaves with the first
    # token: until a stream's first byte, a router may still retry the request elsewhere.
    opening = chunk([ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                     for i in range(request.n)])
    # plain content (no tools, no logprobs) is written as bytes directly (`sse_chunks`)
    plain = ChatChunks(request_id, created, request.model) \
        if tools is None and not request.logprobs else None
    try:
        sent = StreamUsage([prompt_len])
        if resumed is not None:  # its opening and these tokens went out from another engine
            opening = ""
            sent.add(0, resumed)
            if tools is not None:
                _delta(tools, resumed.outputs[0])  # the tool parser takes the text it saw
        async for _, output in merge(streams):
            check_error(output, had_tokens=sent.tokens[0] > 0)
            sent.add(0, output)
            mark = token_ids_mark(output) if marked else ""
            if plain is not None:
                if output.outputs:
                    yield (opening + mark).encode() + plain.event(output.outputs)
                    opening = ""
                continue
            choices = [
                ChatStreamChoice(
                    index=c.index, delta=_delta(tools, c),
                    logprobs=chat_logprobs(ctx.tokenizer, c, k) if request.logprobs else None,
                    finish_reason=_finish_reason(tools, c), stop_reason=c.stop_reason)
                for c in output.outputs]
            if choices:
                yield opening + mark + chunk(choices)
                opening = ""
        if opening:  # no choice produced a chunk
            yield opening
        if include_usage:
            yield sse(ChatCompletionChunk(id=request_id, created=created, model=request.model,
                                          choices=[], usage=sent.usage()))
        yield sse("[DONE]")
    except Exception as exc:
        yield sse_error(exc)
        yield sse("[DONE]")
