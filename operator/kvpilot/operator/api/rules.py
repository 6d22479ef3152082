"""CEL validation rules as the CRD schema spells them (`x-kubernetes-validations`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import JsonValue

JsonDict = dict[str, JsonValue]
"""A JSON object, as `json_schema_extra` takes it."""


@dataclass(frozen=True)
class CelRule:
    """One `x-kubernetes-validations` entry: a CEL rule, the message it fails with, its field."""

    rule: str
    message: str
    field_path: str | None = None

    def to_json(self) -> JsonDict:
        """Gives the entry as the CRD schema spells it."""
        entry: JsonDict = {"rule": self.rule, "message": self.message}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        return entry


def validations(rules: Sequence[CelRule]) -> JsonDict:
    """Gives the `json_schema_extra` that puts `rules` into a type's schema."""
    return {"x-kubernetes-validations": [rule.to_json() for rule in rules]}
