"""Structural OpenAPI v3 schemas and CRD manifests built from the pydantic models.

Pydantic gives JSON Schema 2020-12 with `$ref`s and `anyOf: [X, null]` for
optionals; Kubernetes wants a structural schema: every node typed, no refs, no
`anyOf` with a null branch, free-form objects only where marked with
`x-kubernetes-preserve-unknown-fields`. This module does that translation and
adds the CRD-only parts (printer columns, short names, subresources).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from kvpilot.operator.api.names import name_rules

# JSON Schema keywords Kubernetes accepts in a CRD's openAPIV3Schema (subset we emit).
_KEEP = {
    "type", "description", "properties", "required", "items", "additionalProperties", "enum",
    "default", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
    "maxLength", "pattern", "minItems", "maxItems", "minProperties", "maxProperties", "format",
    "nullable",
    "x-kubernetes-validations", "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-int-or-string", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
}


@dataclass(frozen=True)
class Column:
    """One `additionalPrinterColumns` entry."""

    name: str
    json_path: str
    type: str = "string"
    description: str = ""
    priority: int = 0

    def to_json(self) -> dict[str, Any]:
        """Gives the CRD's camelCase column entry."""
        out: dict[str, Any] = {"name": self.name, "type": self.type, "jsonPath": self.json_path}
        if self.description:
            out["description"] = self.description
        if self.priority:
            out["priority"] = self.priority
        return out


@dataclass(frozen=True)
class Kind:
    """Everything a CRD needs besides the schema."""

    kind: str
    plural: str
    description: str
    spec: type[BaseModel]
    status: type[BaseModel]
    short_names: list[str]
    columns: list[Column]
    scale: bool = False
    categories: list[str] = field(default_factory=lambda: ["kvpilot"])


def structural(model: type[BaseModel]) -> dict[str, Any]:
    """Gives the structural OpenAPI v3 schema of `model` (refs inlined, nulls removed)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _convert(raw, defs)


def _convert(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = dict(node)
    if "default" in node and node["default"] is None:
        node.pop("default")  # Optional fields: unset, never `default: null` (not nullable)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        merged = {**target, **node}  # siblings of the ref (default, description) win
        if "description" in node:
            merged["description"] = node["description"]
        return _convert(merged, defs)
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) == 1:
            return _convert({**branches[0], **node}, defs)
        types = {b.get("type") for b in branches}
        if types == {"string", "integer"}:
            return _keep({**node, "x-kubernetes-int-or-string": True})
        raise ValueError(f"cannot express anyOf {branches} in a structural schema")
    if node.get("const") is not None:
        node["enum"] = [node.pop("const")]
    out = _keep(node)
    if out.get("type") == "object" and "maxLength" in out:
        out["maxProperties"] = out.pop("maxLength")  # pydantic's max_length of a dict
    if out.get("type") == "object":
        props = node.get("properties")
        if props:
            out["properties"] = {k: _convert(v, defs) for k, v in props.items()}
            out.pop("additionalProperties", None)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            out["additionalProperties"] = _convert(extra, defs)
        elif not props:
            # dict[str, Any]: a free-form object kept as given (affinity, tolerations).
            out.pop("additionalProperties", None)
            out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("type") == "array":
        out["items"] = _convert(node.get("items", {}), defs)
    if out.get("type") == "object" and "properties" in out and not out.get("required"):
        out.pop("required", None)
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if not out.get("type") and not out.get("x-kubernetes-int-or-string"):
        out["x-kubernetes-preserve-unknown-fields"] = True
        out["type"] = "object"
    return out


def _keep(node: dict[str, Any]) -> dict[str, Any]:
    out = {k: copy.deepcopy(v) for k, v in node.items() if k in _KEEP}
    if "description" in out:
        out["description"] = " ".join(out["description"].split())
    # JSON Schema 2020-12 bounds are numbers; OpenAPI v3.0 (Kubernetes) wants a boolean flag.
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if not isinstance(out.get(exclusive), bool) and exclusive in out:
            out[bound] = out.pop(exclusive)
            out[exclusive] = True
    return out


def crd(kind: Kind, group: str, version: str) -> dict[str, Any]:
    """Gives the CustomResourceDefinition manifest of one kind."""
    spec_schema = structural(kind.spec)
    status_schema = structural(kind.status)
    subresources: dict[str, Any] = {"status": {}}
    if kind.scale:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    schema = {
        "type": "object",
        "description": kind.description,
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
        "required": ["spec"],
        # Only root rules may read metadata.name; they bound the names the operator derives.
        "x-kubernetes-validations": [rule.to_json() for rule in name_rules(kind.kind)],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{kind.plural}.{group}"},
        "spec": {
            "group": group,
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.kind.lower(),
                "shortNames": kind.short_names,
                "categories": kind.categories,
            },
            "scope": "Namespaced",
            "versions": [{
                "name": version,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": schema},
                "subresources": subresources,
                "additionalPrinterColumns": [c.to_json() for c in kind.columns],
            }],
        },
    }
