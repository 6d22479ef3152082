"""POST /v1/completions: one engine request per prompt, answered whole or as an SSE stream."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request

from kvpilot.engine.contracts.outputs import CompletionOutput, RequestOutput
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.core_process.client import OutputStream
from kvpilot.engine.server.params import completion_prompts, prompt_chars, sampling_params
from kvpilot.engine.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
from kvpilot.engine.server.sse_chunks import CompletionChunks
from kvpilot.engine.server.stream_resume import marks_token_ids, resumed_output, token_ids_mark


def completion_logprobs(tokenizer: TokenizerLike, completion: CompletionOutput, k: int,
                        text_offset: int) -> CompletionLogprobs:
    """Gives the legacy logprobs lists for the tokens of `completion`, whose text starts at
    `text_offset` of the choice's whole text."""
    out = CompletionLogprobs()
    offset = text_offset
    for tid, entry in token_logprobs(completion):
        text = token_text(tokenizer, tid, entry)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        out.token_logprobs.append(entry[tid].logprob if entry and tid in entry else None)
        out.top_logprobs.append(
            {token_text(tokenizer, alt, entry): lp for alt, lp in ranked(entry, k)}
            if entry else None)
    return out


async def create_completion(request: CompletionRequest, raw: Request, ctx: ServingContext,
                            lora_name: str | None = None
                            ) -> CompletionResponse | GenerationStream:
    """Gives the completion of every prompt (with LoRA adapter `lora_name`), or a stream of
    chunks when `stream` is set."""
    arrival = time.monotonic()
    # tokenising (a 1 MB prompt: ~2 s of CPU) in a worker thread keeps the loop serving
    chars = prompt_chars(request, ctx.limits)
    prompts = await ctx.tokenising(chars, completion_prompts, request, ctx.tokenizer,
                                   ctx.limits)
    # off the loop too: a JSON schema's grammar is compiled to be checked
    params = await ctx.off_loop(lambda: [sampling_params(request, len(ids), ctx.limits)
                                         for ids in prompts])
    request_id, streams = await admit_requests(ctx, "cmpl", prompts, params, arrival,
                                               request.priority, request.stream, lora_name,
                                               given_request_id(raw))
    if request.stream:
        marked = marks_token_ids(raw, True, request.n * len(prompts))
        body = _stream(request, ctx, request_id, streams, prompts, marked,
                       resumed_output(prompts[0], params[0], ctx.tokenizer))
        return GenerationStream(body, ctx.gate, streams, ctx.resumable if marked else None,
                                request_id)
    try:
        finals = await cancel_on_disconnect(raw, _collect(streams))
    finally:
        ctx.gate.release()
    return _response(request, ctx, request_id, finals, prompts)


async def _collect(streams: list[OutputStream]) -> list[RequestOutput | None]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, output in merge(streams):
        finals[i] = output
    return finals


def _response(request: CompletionRequest, ctx: ServingContext, request_id: str,
              finals: list[RequestOutput | None], prompts: list[list[int]]) -> CompletionResponse:
    choices: list[CompletionChoice] = []
    for i, output in enumerate(finals):
        if output is None:
            continue
        check_error(output)
        for c in output.outputs:
            logprobs = (completion_logprobs(ctx.tokenizer, c, request.logprobs, 0)
                        if request.logprobs is not None else None)
            choices.append(CompletionChoice(
                index=i * request.n + c.index, text=c.text, logprobs=logprobs,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if request.return_token_ids else None))
    return CompletionResponse(id=request_id, model=request.model, choices=choices,
                              usage=usage_of(finals, [len(p) for p in prompts]))


async def _stream(request: CompletionRequest, ctx: ServingContext, request_id: str,
                  streams: list[OutputStream], prompts: list[list[int]], marked: bool,
                  resumed: RequestOutput | None) -> AsyncGenerator[str | bytes, None]:
    """Gives the SSE events of the completions; `marked`, each token event begins with its
    token ids (`stream_resume`); `resumed`, the stream continues one another engine began."""
    created = request.resume.created if request.resume and request.resume.created \
        else int(time.time())
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    sent = StreamUsage([len(p) for p in prompts])
    if resumed is not None:  # these tokens went out from another engine
        sent.add(0, resumed)
        sent.text_offset(0, resumed.outputs[0])
    # without logprobs, the chunks are written as bytes directly (`sse_chunks`: same JSON)
    plain = CompletionChunks(request_id, created, request.model) \
        if request.logprobs is None else None
    try:
        async for i, output in merge(streams):
            check_error(output, had_tokens=sent.tokens[i] > 0)
            sent.add(i, output)
            mark = token_ids_mark(output) if marked else ""
            if plain is not None:
                if output.outputs:
                    yield mark.encode() + plain.event(
                        [(i * request.n + c.index, c) for c in output.outputs])
                continue
            choices = []
            for c in output.outputs:
                index = i * request.n + c.index
                start = sent.text_offset(index, c)
                logprobs = (completion_logprobs(ctx.tokenizer, c, request.logprobs, start)
                            if request.logprobs is not None else None)
                choices.append(CompletionChoice(index=index, text=c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason))
            if choices:
                yield mark + sse(CompletionResponse(id=request_id, created=created,
                                                    model=request.model, choices=choices))
        if include_usage:
            yield sse(CompletionResponse(id=request_id, created=created, model=request.model,
                                         choices=[], usage=sent.usage()))
        yield sse("[DONE]")
    except Exception as exc:
        yield sse_error(exc)
        yield sse("[DONE]")
