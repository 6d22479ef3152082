"""What a request's output must match (vLLM's `StructuredOutputsParams`), torch-free.

Exactly one of the constraints is set. A JSON schema travels serialised, so the
value crosses the API-server/core boundary (msgpack) as plain strings; the
grammar library compiles it in the core (`kvpilot.engine.structured`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint: a JSON schema, any JSON object, a regex, a choice or a grammar."""

    json: str | None = None  # a JSON schema, serialised
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # a Lark grammar (llguidance's dialect; GBNF is not taken)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the fields unless exactly one constraint is set."""
        given = [name for name, value in (("json", self.json), ("json_object", self.json_object),
                                          ("regex", self.regex), ("choice", self.choice),
                                          ("grammar", self.grammar)) if value]
        if len(given) != 1:
            raise ValueError(f"structured_outputs sets {given or 'nothing'}: set exactly one of "
                             "json, json_object, regex, choice or grammar")
        if self.choice is not None and not all(self.choice):
            raise ValueError(f"structured_outputs.choice={self.choice!r} has an empty choice: "
                             "send non-empty strings")
