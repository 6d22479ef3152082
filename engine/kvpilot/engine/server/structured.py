"""A request's output constraint: from `response_format`, `structured_outputs` or `tool_choice`.

`tool_choice="required"` or a named function is enforced through the same
path as a JSON schema (as vLLM does): the model must write the call's JSON, so
the reply is a call whatever the weights. Refusals are 400s naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.engine.server.protocol_tools import ChatTool, NamedToolChoice
from kvpilot.engine.structured.grammar import check_grammar

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def named_tool(request: ChatCompletionRequest) -> ChatTool | None:
    """Gives the tool a named `tool_choice` picks (400 when no tool has that name)."""
    choice = request.tool_choice
    if not isinstance(choice, NamedToolChoice):
        return None
    tool = next((t for t in request.tools or [] if t.function.name == choice.function.name), None)
    if tool is None:
        names = [t.function.name for t in request.tools or []]
        raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not "
                          f"in tools {names}: name one of them", "tool_choice")
    return tool


def _required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """Gives the schema of a reply that is a list of calls, each {name, parameters} (vLLM's)."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": t.function.parameters or _ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _from_tool_choice(request: ChatCompletionRequest) -> StructuredOutputsParams | None:
    choice = request.tool_choice
    if choice is not None and not request.tools:
        raise bad_request("tool_choice needs tools: send tools or drop tool_choice",
                          "tool_choice")
    tool = named_tool(request)
    if tool is not None:
        return StructuredOutputsParams(json=json.dumps(tool.function.parameters or _ANY_OBJECT))
    if choice == "required":
        assert request.tools
        return StructuredOutputsParams(json=json.dumps(
            _required_schema(request.tools, request.parallel_tool_calls)))
    return None


def _from_fields(request: CompletionRequest | ChatCompletionRequest
                 ) -> tuple[StructuredOutputsParams | None, str]:
    """Gives the constraint of `response_format` or `structured_outputs`, and its field."""
    fmt, so = request.response_format, request.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise bad_request("response_format and structured_outputs both constrain the output: "
                          "send one of them", "structured_outputs")
    try:
        if so is not None:
            json_schema = so.json_ if isinstance(so.json_, str) or so.json_ is None \
                else json.dumps(so.json_)
            return StructuredOutputsParams(json=json_schema, json_object=bool(so.json_object),
                                           regex=so.regex, choice=so.choice,
                                           grammar=so.grammar), "structured_outputs"
    except ValueError as exc:
        raise bad_request(str(exc), "structured_outputs") from exc
    if fmt is None or fmt.type == "text":
        return None, "response_format"
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema: "
                          "send the schema", "response_format")
    return StructuredOutputsParams(json=json.dumps(fmt.json_schema.schema_)), "response_format"


def structured_outputs_of(request: CompletionRequest | ChatCompletionRequest
                          ) -> StructuredOutputsParams | None:
    """Gives the output constraint of `request`, its grammar checked; raises a 400 naming
    the field when it is invalid or cannot run with the rest of the request."""
    given = [name for name in _GUIDED if getattr(request, name) is not None]
    if given:
        raise bad_request(f"{given[0]} was removed in vLLM v0.12 and kvpilot does not take it: "
                          f"send structured_outputs={{\"{given[0].removeprefix('guided_')}\": "
                          "...}} instead", given[0])
    params, field = _from_fields(request)
    if isinstance(request, ChatCompletionRequest):
        from_tools = _from_tool_choice(request)
        if from_tools is not None:
            if params is not None:
                raise bad_request("tool_choice (required or a named function) constrains the "
                                  f"reply to a tool call, so {field} cannot apply: drop one",
                                  "tool_choice")
            params, field = from_tools, "tool_choice"
    if params is None:
        return None
    if request.n != 1:
        raise bad_request(f"n={request.n} is not supported with {field}: one grammar state per "
                          "request; send n=1", "n")
    try:
        check_grammar(params)
    except ValueError as exc:
        raise bad_request(str(exc), field) from exc
    return params

