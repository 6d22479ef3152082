"""What the API server does to a custom object, redone for tests: defaulting, schema, CEL.

- `apply_defaults` fills `default`s top-down the way structural defaulting does
  (an object default of {} is filled in, then its own properties' defaults);
- `schema_errors` checks the OpenAPI v3.0 schema with jsonschema's Draft 4 validator
  (OpenAPI 3.0's boolean exclusiveMinimum is Draft 4's);
- `cel_errors` evaluates every `x-kubernetes-validations` rule with cel-python, `self`
  bound to the value at the rule's location (transition rules with oldSelf skipped).
Also imported by tests/chart (by path), so it keeps a unique module name.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "crds"


@functools.cache
def load_crds(directory: Path = CRD_DIR) -> dict[str, dict[str, Any]]:
    """Gives the CRDs in `directory` keyed by kind (read once; do not mutate)."""
    crds = {}
    for path in sorted(directory.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        crds[crd["spec"]["names"]["kind"]] = crd
    return crds


def openapi(crd: dict[str, Any]) -> dict[str, Any]:
    """Gives the openAPIV3Schema of a CRD's only version."""
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Gives a copy of `obj` with the schema's defaults filled in."""
    obj = copy.deepcopy(obj)
    _default(schema, obj)
    return obj


def _default(schema: dict[str, Any], obj: Any) -> None:
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                _default(sub, obj[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for value in obj.values():
                _default(extra, value)
    elif isinstance(obj, list) and "items" in schema:
        for item in obj:
            _default(schema["items"], item)


def schema_errors(schema: dict[str, Any], obj: Any) -> list[str]:
    """Gives 'path: message' for each OpenAPI schema violation of `obj`."""
    from jsonschema import Draft4Validator

    validator = Draft4Validator(schema)
    return sorted([f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
                   for e in validator.iter_errors(obj)] + list_map_errors(schema, obj))


def list_map_errors(schema: dict[str, Any], obj: Any, path: tuple[str, ...] = ()) -> list[str]:
    """Gives 'path.i: Duplicate value' for each item of an `x-kubernetes-list-type: map` list
    whose keys repeat an earlier item's (the API server refuses those before CEL runs)."""
    errors: list[str] = []
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in obj:
                errors += list_map_errors(sub, obj[name], (*path, name))
    elif isinstance(obj, list) and "items" in schema:
        keys = schema.get("x-kubernetes-list-map-keys")
        seen: list[Any] = []
        for i, item in enumerate(obj):
            if keys and schema.get("x-kubernetes-list-type") == "map" and isinstance(item, dict):
                key = {k: item.get(k) for k in keys}
                if key in seen:
                    errors.append(f"{'.'.join((*path, str(i)))}: Duplicate value: {key}")
                seen.append(key)
            errors += list_map_errors(schema["items"], item, (*path, str(i)))
    return errors


def cel_sites(schema: dict[str, Any], path: tuple[str, ...] = ()) \
        -> list[tuple[tuple[str, ...], list[dict[str, str]]]]:
    """Gives (path, rules) for every schema node carrying x-kubernetes-validations."""
    sites = []
    if schema.get("x-kubernetes-validations"):
        sites.append((path, schema["x-kubernetes-validations"]))
    for name, sub in schema.get("properties", {}).items():
        sites += cel_sites(sub, (*path, name))
    if isinstance(schema.get("additionalProperties"), dict):
        sites += cel_sites(schema["additionalProperties"], (*path, "*"))
    if "items" in schema:
        sites += cel_sites(schema["items"], (*path, "*"))
    return sites


def values_at(obj: Any, path: tuple[str, ...]) -> list[Any]:
    """Gives the values present at `path` ('*' walks every list item or map value)."""
    if not path:
        return [obj]
    head, rest = path[0], path[1:]
    if head == "*":
        children = obj if isinstance(obj, list) else list(obj.values()) \
            if isinstance(obj, dict) else []
        return [v for child in children for v in values_at(child, rest)]
    if isinstance(obj, dict) and head in obj:
        return values_at(obj[head], rest)
    return []


def cel_errors(schema: dict[str, Any], obj: Any) -> list[str]:
    """Gives 'path: message' for each CEL rule that rejects the (defaulted) object."""
    import celpy

    errors = []
    for path, rules in cel_sites(schema):
        for value in values_at(obj, path):
            for rule in rules:
                if "oldSelf" in rule["rule"]:
                    continue
                program = _program(rule["rule"])
                result = program.evaluate({"self": celpy.json_to_cel(value)})
                if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
                    errors.append(f"{'.'.join(path)}: {rule['message']}")
    return errors


@functools.cache
def _program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def api_server_errors(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Gives the errors the API server would answer `kubectl apply` of `obj` with."""
    schema = openapi(crd)
    defaulted = apply_defaults(schema, obj)
    return schema_errors(schema, defaulted) or cel_errors(schema, defaulted)
