"""The per-model fleet secret and the client API key, as the pods of engines and routers see them.

The fleet secret authenticates what engines and routers say to each other (KV transfer,
`/kv_events`): one Secret per InferenceModel (or per pool without one), 32 random bytes as
hex under key FLEET_SECRET_KEY, created once and never read or overwritten by the operator,
mounted read-only at FLEET_SECRET_PATH (kvpilot.engine.contracts.fleet_secret). The API key
comes from the user's Secret as the API_KEY_ENV variable (a secretKeyRef: the key never
appears in an object we write).
"""

from __future__ import annotations

import posixpath
import secrets
from typing import Any

from kvpilot.engine.contracts.args import API_KEY_ENV
from kvpilot.engine.contracts.fleet_secret import (
    FLEET_SECRET_KEY,
    FLEET_SECRET_PATH,
    GENERATED_SECRET_BYTES,
)
from kvpilot.operator.api.access import AuthSpec
from kvpilot.operator.api.names import fleet_secret_name
from kvpilot.operator.render.meta import MODEL_LABEL, object_meta

FLEET_VOLUME = "fleet-secret"
FLEET_SECRET_DIR = posixpath.dirname(FLEET_SECRET_PATH)


def fleet_secret(model: str, namespace: str, owner: dict[str, Any]) -> dict[str, Any]:
    """Gives a new fleet Secret for `model` holding fresh random bytes (create it only if absent)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": object_meta(fleet_secret_name(model), namespace, {MODEL_LABEL: model},
                                    owner),
            "stringData": {FLEET_SECRET_KEY: secrets.token_hex(GENERATED_SECRET_BYTES)}}


def fleet_volume(model: str) -> dict[str, Any]:
    """Gives the pod volume of a model's fleet Secret (readable by the pods' group only)."""
    return {"name": FLEET_VOLUME, "secret": {
        "secretName": fleet_secret_name(model), "defaultMode": 0o440,
        "items": [{"key": FLEET_SECRET_KEY, "path": posixpath.basename(FLEET_SECRET_PATH)}]}}


FLEET_MOUNT = {"name": FLEET_VOLUME, "mountPath": FLEET_SECRET_DIR, "readOnly": True}


def api_key_env(auth: AuthSpec) -> list[dict[str, Any]]:
    """Gives the KVPILOT_API_KEY variable from the user's Secret, when auth names one."""
    ref = auth.api_key_secret_ref
    if ref is None:
        return []
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name,
                                                                 "key": ref.key}}}]
