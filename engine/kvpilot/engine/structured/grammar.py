"""The llguidance grammar of a `StructuredOutputsParams`, checked before any engine work.

The API server calls `check_grammar` (in a worker thread) so an invalid schema,
regex or grammar is a 400 that names the field; the core compiles the same
grammar string into a matcher (`structured.matchers`).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance

from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams


def _json_grammar(schema: str | dict[str, Any]) -> str:
    # no whitespace between JSON tokens: the model cannot stall in an endless run of spaces
    # (vLLM's `disable_any_whitespace`), and a random-weight model still ends its object
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, overrides={"whitespace_flexible": False})


def grammar_of(params: StructuredOutputsParams) -> str:
    """Gives the llguidance grammar (a JSON string) that `params` asks the output to match."""
    if params.json is not None:
        return _json_grammar(params.json)
    if params.json_object:
        return _json_grammar({"type": "object"})
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        # Lark string literals take JSON's escapes, so json.dumps quotes any choice
        alternatives = " | ".join(json.dumps(c) for c in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    assert params.grammar is not None, "StructuredOutputsParams.validate: one constraint is set"
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


def field_of(params: StructuredOutputsParams) -> str:
    """Gives the name of the constraint `params` sets (for error messages)."""
    for name in ("json", "regex", "choice", "grammar"):
        if getattr(params, name) is not None:
            return name
    return "json_object"


@functools.lru_cache(maxsize=256)
def _validate(grammar: str) -> str:
    return llguidance.LLMatcher.validate_grammar(grammar)


def check_grammar(params: StructuredOutputsParams) -> str:
    """Gives the grammar of `params`; raises ValueError naming the constraint when it is invalid
    (a schema that is not JSON, a regex or Lark grammar that does not compile)."""
    name = field_of(params)
    try:
        grammar = grammar_of(params)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.{name} is invalid: {exc}: send a valid "
                         f"{name}") from exc
    error = _validate(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"structured_outputs.{name} is invalid: {error.strip()}: fix the "
                         f"{name}")
    return grammar
