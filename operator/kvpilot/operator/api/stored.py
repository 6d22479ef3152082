"""Bases of the three stored kinds: the object envelope and the head of every status.

Pydantic keeps an inherited field where the base declares it, even when a subclass narrows its
type, so the CRDs list the fields in the same order as when each kind declared them all.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from kvpilot.operator.api.base import ApiModel
from kvpilot.operator.api.common import CONDITIONS_LIST, Condition
from kvpilot.operator.api.names import check_name


class FieldDrift(ApiModel):
    """A field of a child another writer had changed, which kvpilot owns and applied back."""

    object: str
    """The child, as Kind/name."""
    field: str
    """The field's path, e.g. .spec.replicas."""
    manager: str
    """The field manager that had changed it, e.g. kubectl-edit."""


class ObservedStatus(ApiModel):
    """Status fields every kind starts with; each kind's status adds its own after them."""

    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=CONDITIONS_LIST)
    """Ready, Progressing and Degraded."""
    observed_generation: int | None = None
    """metadata.generation this status reflects."""
    field_conflicts: list[FieldDrift] | None = None
    """Fields the last reconcile took back from other writers (unset when there were none)."""


class StoredObject(ApiModel):
    """An object's envelope as the API server stores it; each kind declares kind, spec, status."""

    model_config = ConfigDict(extra="ignore")

    api_version: str = "kvpilot.dev/v1alpha1"
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _name(self) -> StoredObject:
        name = self.metadata.get("name")
        if name is not None:
            check_name(type(self).model_fields["kind"].default, str(name))
        return self
