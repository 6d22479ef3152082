"""pydantic -> structural OpenAPI v3: each translation rule on a small model."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from pydantic import ConfigDict, Field

from kvpilot.operator.api.base import ApiModel
from kvpilot.operator.api.rules import CelRule, validations
from kvpilot.operator.api.schema import structural


class Inner(ApiModel):
    """Inner part."""

    size: int = Field(default=2, ge=1)
    """How big."""


class Sample(ApiModel):
    """A sample."""

    model_config = ConfigDict(json_schema_extra=validations([CelRule("true", "never")]))

    name: str = Field(min_length=1, pattern=r"^[a-z]+$")
    """The   name,
    on two lines."""
    mode: Literal["a", "b"] = "a"
    fixed: Literal["only"] = "only"
    ratio: float = Field(default=0.5, gt=0, lt=1)
    inner: Inner = Field(default_factory=Inner, json_schema_extra={"default": {}})
    maybe: Inner | None = None
    quantities: dict[str, str | int] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    free: dict[str, Any] | None = None
    items: list[dict[str, Any]] = Field(default_factory=list)
    anything: Any = None


SCHEMA = structural(Sample)
PROPS = SCHEMA["properties"]


@pytest.mark.parametrize(("field", "expected"), [
    ("name", {"type": "string", "minLength": 1, "pattern": "^[a-z]+$",
              "description": "The name, on two lines."}),
    ("mode", {"type": "string", "enum": ["a", "b"], "default": "a"}),
    ("fixed", {"type": "string", "enum": ["only"], "default": "only"}),
    ("ratio", {"type": "number", "default": 0.5, "minimum": 0, "exclusiveMinimum": True,
               "maximum": 1, "exclusiveMaximum": True}),
    ("inner", {"type": "object", "default": {}, "description": "Inner part.",
               "properties": {"size": {"type": "integer", "default": 2, "minimum": 1,
                                       "description": "How big."}}}),
    ("maybe", {"type": "object", "description": "Inner part.",
               "properties": {"size": {"type": "integer", "default": 2, "minimum": 1,
                                       "description": "How big."}}}),
    ("quantities", {"type": "object",
                    "additionalProperties": {"x-kubernetes-int-or-string": True}}),
    ("labels", {"type": "object", "additionalProperties": {"type": "string"}}),
    ("free", {"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
    ("items", {"type": "array",
               "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}),
    ("anything", {"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
])
def test_field_translation(field: str, expected: dict[str, Any]):
    assert PROPS[field] == expected


def test_model_level_parts():
    assert SCHEMA["type"] == "object"
    assert SCHEMA["required"] == ["name"]
    assert SCHEMA["x-kubernetes-validations"] == [{"rule": "true", "message": "never"}]
    assert "$defs" not in SCHEMA and "title" not in SCHEMA


def test_unexpressible_union_is_refused():
    class Bad(ApiModel):
        value: int | list[str]

    with pytest.raises(ValueError, match="cannot express anyOf"):
        structural(Bad)
