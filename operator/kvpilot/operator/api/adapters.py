"""LoRA adapters of an InferenceModel: each a name clients send as `model` and a PEFT source.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` (PEFT's
layout); the engine serves it beside the base model (`--enable-lora --lora-modules
name=path`). Sources take the base weights' schemes except `dummy:`: hf://org/name
(downloaded by an init container), pvc://claim/path and oci://image (KServe's modelcar
layout). Every rule lives twice, as for the rest of the API: CEL on the InferenceModel
(`ADAPTER_RULES`, refused at `kubectl apply`) and `check_adapters` (the operator and
`kvpilot up`), with the same messages.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pydantic import Field, field_validator

from kvpilot.operator.api.base import ApiModel
from kvpilot.operator.api.rules import CelRule, JsonDict

MAX_ADAPTERS = 32
"""Most adapters one InferenceModel lists (bounds the CEL rules' cost and the pod spec)."""
# A DNS-1123 label short enough that `fetch-adapter-<name>` stays a container name (63).
ADAPTER_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ADAPTER_NAME_MAX = 48
ADAPTER_NAME_FIX = ("adapter names are lowercase letters, digits and '-', alphanumeric at both "
                    f"ends, at most {ADAPTER_NAME_MAX} characters (e.g. sql-lora): rename it")
ADAPTER_SOURCE = (r"^(hf://[^/\s]+/[^\s]+|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/[^\s]*)?|"
                  r"oci://[^\s]+)$")
ADAPTER_SOURCE_FIX = ("write hf://org/name, pvc://claim/path or oci://registry/image:tag (a "
                      "PEFT directory: adapter_config.json and adapter_model.safetensors)")
DEFAULT_MAX_LORAS = 4
"""--max-loras when spec.engine.maxLoras is unset: min(adapters, 4). vLLM's default of 1
would swap adapters in and out on every other step of a mixed batch."""
# Adapters merge by name under server-side apply, and the API server refuses a repeated name.
ADAPTERS_LIST: JsonDict = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}

UNIQUE = "adapter names must be unique: rename or remove the repeated one"
NOT_THE_MODEL = "an adapter may not take spec.model.name (the base model's): rename the adapter"
AGGREGATED_ONLY = ("adapters need servingMode aggregated (the engine's LoRA runs with role "
                   "both): switch it, or remove spec.adapters")
LORA_FIELDS_NEED_ADAPTERS = ("engine.maxLoras/maxLoraRank need an InferenceModel's "
                             "spec.adapters: add adapters or unset them")
ADAPTER_RULES = [
    CelRule("!has(self.adapters) || self.adapters.all(a, a.name != self.model.name)",
            NOT_THE_MODEL, ".adapters"),
    CelRule("!has(self.adapters) || self.servingMode == 'aggregated'", AGGREGATED_ONLY,
            ".adapters"),
    CelRule("has(self.adapters) || (!has(self.engine.maxLoras) && !has(self.engine.maxLoraRank))",
            LORA_FIELDS_NEED_ADAPTERS, ".engine.maxLoras"),
]


class AdapterSpec(ApiModel):
    """One LoRA adapter served beside the base model."""

    name: str = Field(max_length=ADAPTER_NAME_MAX,
                      json_schema_extra={"pattern": ADAPTER_NAME})
    """What clients send as `model` to use it."""
    source: str = Field(json_schema_extra={"pattern": ADAPTER_SOURCE})
    """A PEFT directory: hf://org/name, pvc://claim/path or oci://image (under /models)."""
    revision: str | None = Field(default=None, max_length=255)
    """Revision of an hf:// source."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.search(ADAPTER_NAME, value):
            raise ValueError(f"name={value!r}: {ADAPTER_NAME_FIX}")
        return value

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if not re.search(ADAPTER_SOURCE, value):
            raise ValueError(f"source={value!r} is not an adapter source: {ADAPTER_SOURCE_FIX}")
        return value


def check_adapters(adapters: Sequence[AdapterSpec], model_name: str, serving_mode: str,
                   lora_fields_set: bool) -> None:
    """Raises ValueError naming `spec.adapters[i]` (or the engine field) and the fix when the
    adapters break a rule of `ADAPTER_RULES`."""
    seen: set[str] = set()
    for i, adapter in enumerate(adapters):
        if adapter.name in seen:
            raise ValueError(f"spec.adapters[{i}].name={adapter.name!r} repeats: {UNIQUE}")
        seen.add(adapter.name)
        if adapter.name == model_name:
            raise ValueError(f"spec.adapters[{i}].name={adapter.name!r} equals spec.model.name: "
                             f"{NOT_THE_MODEL}")
    if adapters and serving_mode != "aggregated":
        raise ValueError(f"spec.adapters with servingMode={serving_mode}: {AGGREGATED_ONLY}")
    if lora_fields_set and not adapters:
        raise ValueError(f"spec.engine.maxLoras/maxLoraRank without spec.adapters: "
                         f"{LORA_FIELDS_NEED_ADAPTERS}")
