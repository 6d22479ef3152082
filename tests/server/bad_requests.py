"""The engine's bad-input table: request bodies an engine answers with a 4xx naming the
field; the engine's own tests and the router's parity test (`test_router_parity.py`) send
them."""

from __future__ import annotations

from typing import Any

from server_harness import MODEL

OK_COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (route, fields changed from a valid body, expected status, expected param)
CASES: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("/v1/completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 600}, 400, "max_tokens"),
    ("/v1/completions", {"temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"n": 0}, 400, "n"),
    ("/v1/completions", {"n": "two"}, 400, "n"),
    ("/v1/completions", {"logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"stop": [""]}, 400, "stop"),
    ("/v1/completions", {"stop": 5}, 400, "stop"),
    ("/v1/completions", {"seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"stream": "yes please"}, 400, "stream"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "word " * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": None}, 400, "prompt"),
    # a lone surrogate (JSON "\ud800") reached the tokenizer: TypeError, a 500
    ("/v1/completions", {"prompt": "\ud800"}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "a\udc00b"]}, 400, "prompt.1"),
    ("/v1/completions", {"stop": ["\ud800"]}, 400, "stop.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400,
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "x\ud800"}]}]}, 400,
     "messages.0.content.1.text"),
    ("/v1/completions", {"echo": True}, 400, "echo"),
    ("/v1/completions", {"suffix": "tail"}, 400, "suffix"),
    # logit_bias is applied (issue 49); keys must be token ids, biases in [-100, 100]
    ("/v1/completions", {"logit_bias": {"99999": 1.0}}, 400, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"five": 1.0}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"model": None}, 400, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, 400, "tools.0.function"),
    # structured outputs and tool calls (issue 24)
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "wizard"}}}}, 400, "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "(("}}, 400, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {}}, 400, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: ???"}}, 400,
     "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json": "{not json"}}, 400,
     "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"whitespace_pattern": " "}}, 400,
     "structured_outputs.whitespace_pattern"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, 400, "guided_json"),
    ("/v1/completions", {"structured_outputs": {"regex": "a+"}, "min_tokens": 1}, 400,
     "min_tokens"),
    ("/v1/completions", {"structured_outputs": {"regex": "a+"}, "ignore_eos": True}, 400,
     "ignore_eos"),
    ("/v1/completions", {"guided_choice": ["a"]}, 400, "guided_choice"),
    ("/v1/completions", {"structured_outputs": {"choice": ["a"]},
                         "response_format": {"type": "json_object"}}, 400, "structured_outputs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}},
     400, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     400, "messages"),
    ("/v1/chat/completions", {"model": "other"}, 404, "model"),
    # what a disaggregated fleet's router sends (issue 22): the prefill's token ids, the
    # decode's given first token
    ("/v1/completions", {"return_token_ids": True, "stream": True}, 400, "return_token_ids"),
    ("/v1/completions", {"first_token_id": 5000}, 400, "first_token_id"),
    ("/v1/completions", {"first_token_id": -1}, 400, "first_token_id"),
    ("/v1/completions", {"first_token_id": 5, "n": 2}, 400, "first_token_id"),
    # issue 49: NaN is no temperature (it was "should be <= 2"), a negative id is no token
    # id (it was "should be a valid string"), an empty prompt is no prompt (it ran)
    ("/v1/completions", {"temperature": float("nan")}, 400, "temperature"),
    ("/v1/chat/completions", {"top_p": float("inf")}, 400, "top_p"),
    ("/v1/completions", {"prompt": [-5]}, 400, "prompt.0"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["fine", ""]}, 400, "prompt.1"),
    ("/v1/completions", {"prompt": "a\ud800b", "stream": True}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}],
                              "stream": True}, 400, "messages.0.content"),
]

# (route, raw body, expected status, expected param): bodies that are no JSON object, and
# JSON escapes Python reads into text UTF-8 cannot hold
RAW_CASES: list[tuple[str, bytes, int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x",}', 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'"text"', 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"\xff\xfe{}", 400, None),
    ("/v1/chat/completions", b"null", 400, None),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "a\\ud800b"}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "stop": ["\\udfff"]}', 400,
     "stop.0"),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "temperature": NaN}', 400,
     "temperature"),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "max_tokens": Infinity}', 400,
     "max_tokens"),
    ("/v1/chat/completions",
     b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud83d"}]}', 400,
     "messages.0.content"),
]
