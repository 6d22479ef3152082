"""What a platform engineer sees of an object: `kubectl get` columns and Argo CD's health.

Shared by tests/operator_api (printer columns), tests/chart (the health Lua) and the
emulator tests in tests/operator, which check both on the objects the operator wrote.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
ARGOCD = ROOT / "charts" / "kvpilot" / "files" / "argocd"
LUA_SCRIPTS = {"InferenceModel": "inferencemodel.lua", "PrefillPool": "pool.lua",
               "DecodePool": "pool.lua"}
_STEP = re.compile(r'\.(\w+)|\[\?\(@\.(\w+)=="([^"]*)"\)\]')


def jsonpath(obj: Any, path: str) -> list[Any]:
    """Gives the values of the `.a.b` and `.a[?(@.k=="v")].b` forms kubectl uses in columns."""
    values, pos = [obj], 0
    while pos < len(path):
        step = _STEP.match(path, pos)
        assert step, f"unsupported JSONPath {path!r} at {path[pos:]!r}"
        key, filter_key, filter_value = step.groups()
        if key:
            values = [v[key] for v in values if isinstance(v, dict) and key in v]
        else:
            values = [item for v in values if isinstance(v, list) for item in v
                      if isinstance(item, dict) and item.get(filter_key) == filter_value]
        pos = step.end()
    return values


def columns(obj: dict[str, Any]) -> dict[str, str]:
    """Gives column name -> cell text as `kubectl get` prints it (empty cell when absent),
    from the committed CRD of the object's kind (priority-0 columns)."""
    crd = next(c for p in sorted((ROOT / "crds").glob("*.yaml"))
               if (c := yaml.safe_load(p.read_text()))["spec"]["names"]["kind"] == obj["kind"])
    out = {}
    for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        if column.get("priority", 0):
            continue
        found = jsonpath(obj, column["jsonPath"])
        out[column["name"]] = "" if not found else str(found[0])
    return out


def lua_script(kind: str) -> str:
    """Gives the standalone script the chart renders for `kind`: its replicas() + health.lua."""
    return (ARGOCD / LUA_SCRIPTS[kind]).read_text() + "\n" + (ARGOCD / "health.lua").read_text()


def argocd_health(obj: dict[str, Any]) -> tuple[str, str]:
    """Gives (status, message) of Argo CD's health script for `obj`, run in Lua 5.1 (lupa), the
    language of gopher-lua, which Argo CD embeds."""
    from lupa.lua51 import LuaRuntime

    lua = LuaRuntime(unpack_returned_tuples=True)
    assert lua.lua_version == (5, 1)

    def to_lua(value: Any) -> Any:
        if isinstance(value, dict):
            return lua.table_from({k: to_lua(v) for k, v in value.items()})
        if isinstance(value, list):
            return lua.table_from([to_lua(v) for v in value])
        return value

    lua.globals().obj = to_lua(obj)
    result = lua.execute(lua_script(obj["kind"]))
    return result["status"], result["message"]
