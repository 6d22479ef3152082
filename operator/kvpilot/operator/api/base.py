"""The base of every API type: camelCase JSON, unknown fields rejected, docstrings as descriptions."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    """Base of every API type: camelCase JSON, unknown fields rejected, docstrings as descriptions."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )

    def to_json(self) -> dict[str, Any]:
        """Gives the camelCase dict the API server stores (unset optionals left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
