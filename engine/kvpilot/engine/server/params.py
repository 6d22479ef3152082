"""Turns API request bodies into engine prompts and SamplingParams, refusing what cannot run.

Every refusal is a 400 whose `param` names the field, with the value and the
fix in the message. The length check happens here, on token ids, so a client
learns its prompt plus `max_tokens` is too long before any engine work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.server.errors import bad_request, from_value_error
from kvpilot.engine.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from kvpilot.engine.server.structured import structured_outputs_of


@dataclass
class Limits:
    """What the loaded model can take; `max_prompt_chars` (None: unchecked) bounds the text
    tokenised for one request (`contracts.request_limits`)."""

    max_model_len: int
    vocab_size: int
    max_prompt_chars: int | None = None


def prompt_chars(request: CompletionRequest | ChatCompletionRequest, limits: Limits) -> int:
    """Gives the characters of text the request asks to tokenise; a 400 naming the field
    when they are more than `limits.max_prompt_chars` (before any tokenising: a 16 MB
    prompt took 20 s to be found too long)."""
    if isinstance(request, ChatCompletionRequest):
        param = "messages"
        chars = sum(len(m.text()) for m in request.messages)
    else:
        param = "prompt"
        prompt = request.prompt
        chars = len(prompt) if isinstance(prompt, str) else sum(
            len(p) if isinstance(p, str | list) else 1 for p in prompt)
    limit = limits.max_prompt_chars
    if limit is not None and chars > limit:
        raise bad_request(
            f"{param} has {chars} characters, more than this server tokenises for one request "
            f"({limit}, --max-prompt-chars; by default the most that can fit max_model_len="
            f"{limits.max_model_len} tokens): shorten the {param}", param)
    return chars


def _check_common(request: SamplingFields) -> None:
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream=true: set stream=true "
                          "or remove stream_options", "stream_options")
    if request.return_token_ids and request.stream:
        raise bad_request("return_token_ids=true works with stream=false only: set "
                          "stream=false or remove return_token_ids", "return_token_ids")
    if request.resume is not None and not (request.stream and request.n == 1):
        raise bad_request("resume continues one streamed completion: send stream=true and "
                          "n=1, or remove resume", "resume")


def completion_prompts(request: CompletionRequest, tokenizer: TokenizerLike,
                       limits: Limits) -> list[list[int]]:
    """Gives one token-id list per prompt of a completions request."""
    _check_common(request)
    if request.suffix:
        raise bad_request("suffix is not supported by kvpilot: remove it", "suffix")
    if request.echo:
        raise bad_request("echo=true is not supported by kvpilot: send echo=false", "echo")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request(f"best_of={request.best_of} is not supported: kvpilot samples n "
                          "completions; omit best_of or set it equal to n", "best_of")
    raw = request.prompt
    if isinstance(raw, str):
        items: list[str | list[int]] = [raw]
    else:  # one list of token ids, or a list of prompts (the schema allows no mix)
        token_ids = [x for x in raw if isinstance(x, int)]
        items = [token_ids] if token_ids else [x for x in raw if not isinstance(x, int)]
    if not items:
        raise bad_request("prompt=[] is invalid: send at least one prompt", "prompt")
    if request.resume is not None and len(items) > 1:
        raise bad_request(f"resume continues one completion, but prompt holds {len(items)} "
                          "prompts: send one prompt, or remove resume", "resume")
    for i, item in enumerate(items):
        if item == "":  # encodes to BOS alone: nothing to continue, as vLLM refuses it
            param = "prompt" if isinstance(raw, str) else f"prompt.{i}"
            raise bad_request(f"{param}='' is empty: send at least one character", param)
    prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in items]
    for ids in prompts:
        check_prompt(ids, limits, "prompt")
    return prompts


def chat_prompt(request: ChatCompletionRequest, tokenizer: TokenizerLike,
                limits: Limits) -> list[int]:
    """Gives the token ids of the chat rendered through the tokenizer's chat template."""
    _check_common(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request(f"top_logprobs={request.top_logprobs} needs logprobs=true: "
                          "set logprobs=true", "top_logprobs")
    messages = [_template_message(m) for m in request.messages]
    try:
        if request.tools:  # the template's own tool format (its Jinja `tools` variable)
            tools = [t.model_dump(exclude_none=True) for t in request.tools]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tools=tools)
        else:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as exc:  # a template may raise on role orders it does not allow
        raise bad_request(f"messages cannot be rendered by the chat template: {exc}",
                          "messages") from exc
    # The template writes any BOS itself; adding special tokens again would double it.
    ids = tokenizer.encode(text, add_special_tokens=False)
    check_prompt(ids, limits, "messages")
    return ids


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """Gives one message as chat templates read it: tool calls with their arguments parsed
    (templates write them with `tojson`), and the id a tool turn answers."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": c.type,
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"messages has a tool call whose arguments are not JSON ({exc}): "
                          "send the arguments as a JSON object's text", "messages") from exc


def check_prompt(ids: list[int], limits: Limits, param: str) -> None:
    """Raises a 400 naming `param` when the prompt is empty, too long or out of vocabulary."""
    if not ids:
        raise bad_request(f"{param} is empty after tokenisation: send at least one token", param)
    if len(ids) >= limits.max_model_len:
        raise bad_request(f"{param} has {len(ids)} tokens, but this model's maximum context "
                          f"length is {limits.max_model_len} tokens: shorten the {param}", param)
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param} has token id {bad}, outside the vocabulary of "
                          f"{limits.vocab_size}: send ids in [0, {limits.vocab_size})", param)


def _max_tokens(requested: int | None, param: str, prompt_len: int, limits: Limits) -> int:
    room = limits.max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"{param}={requested} is too large: this model's maximum context length is "
            f"{limits.max_model_len} tokens and the prompt has {prompt_len}; "
            f"set {param} to at most {room}", param)
    return requested


def _logit_bias(bias: dict[str, float] | None, limits: Limits) -> dict[int, float] | None:
    """Gives OpenAI's `logit_bias` ({"token id": bias}) with int keys; a 400 naming it when a
    key is no token id of this vocabulary or a bias is outside [-100, 100]."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if key.strip().isdigit() else -1
        if not 0 <= token < limits.vocab_size:
            raise bad_request(f"logit_bias has key {key[:20]!r}, not a token id of this model: "
                              f"use ids in [0, {limits.vocab_size}) as strings", "logit_bias")
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias[{key!r}]={value} is invalid: biases are in "
                              "[-100, 100]", "logit_bias")
        out[token] = value
    return out


def sampling_params(request: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                    limits: Limits) -> SamplingParams:
    """Gives the SamplingParams of `request` for a prompt of `prompt_len` tokens."""
    if isinstance(request, ChatCompletionRequest):
        param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        requested = request.max_completion_tokens or request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        param, requested, logprobs = "max_tokens", request.max_tokens, request.logprobs
    if logprobs is not None:
        # Ask the engine for at least one alternative: the response keeps only the
        # requested number, and engines need not special-case k = 0.
        logprobs = max(logprobs, 1)
    fields: dict[str, Any] = {
        "n": request.n,
        "max_tokens": _max_tokens(requested, param, prompt_len, limits),
        "min_tokens": request.min_tokens,
        "seed": request.seed,
        "stop": [request.stop] if isinstance(request.stop, str) else list(request.stop or []),
        "stop_token_ids": list(request.stop_token_ids or []),
        "ignore_eos": request.ignore_eos,
        "logprobs": logprobs,
        "skip_special_tokens": request.skip_special_tokens,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "structured_outputs": structured_outputs_of(request),
        "first_token_id": request.first_token_id,
        "resume_token_ids": list(request.resume.token_ids) if request.resume else None,
        "logit_bias": _logit_bias(request.logit_bias, limits),
    }
    optional = {"temperature": request.temperature, "top_p": request.top_p,
                "top_k": request.top_k, "min_p": request.min_p,
                "presence_penalty": request.presence_penalty,
                "frequency_penalty": request.frequency_penalty,
                "repetition_penalty": request.repetition_penalty}
    fields.update({k: v for k, v in optional.items() if v is not None})
    if fields.get("top_k", 0) > limits.vocab_size:
        fields["top_k"] = limits.vocab_size  # keeping more than the vocabulary keeps all of it
    resumed = fields["resume_token_ids"]
    if resumed is not None and len(resumed) > fields["max_tokens"]:
        raise bad_request(f"resume.token_ids has {len(resumed)} tokens, more than {param}="
                          f"{fields['max_tokens']}: send the tokens of this request's output",
                          "resume")
    if fields["min_tokens"] > fields["max_tokens"]:
        raise bad_request(f"min_tokens={request.min_tokens} is larger than the max_tokens "
                          f"({fields['max_tokens']}): lower min_tokens", "min_tokens")
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        raise from_value_error(exc) from exc
