"""`--speculative-config`: vLLM's JSON shape parsed once into a resolved `SpeculativeConfig`.

The flag holds JSON text; the offline `LLM(speculative_config=...)` also takes the same
object as a dict, or a `SpeculativeConfig`, as vLLM's does.

Two methods, as vLLM spells them:
  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
  {"model": "PATH_OR_BUILTIN", "num_speculative_tokens": 4}   (a draft model; "method" may say
                                                               "draft_model")
Torch-free: the operator renders this flag and `kvpilot serve --help` reads it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NGRAM, DRAFT = "ngram", "draft_model"
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """A resolved speculative-decoding setup: how drafts are proposed and how many per step."""

    method: str  # NGRAM | DRAFT
    num_speculative_tokens: int
    prompt_lookup_max: int = 0  # ngram: longest suffix matched against the context
    prompt_lookup_min: int = 0  # ngram: shortest
    model: str | None = None  # draft: a model directory, Hub id or built-in name

    def to_json(self) -> str:
        """Gives the flag's JSON for this config (what the operator renders)."""
        if self.method == NGRAM:
            body: dict = {"method": NGRAM, "num_speculative_tokens": self.num_speculative_tokens,
                          "prompt_lookup_max": self.prompt_lookup_max,
                          "prompt_lookup_min": self.prompt_lookup_min}
        else:
            body = {"model": self.model, "num_speculative_tokens": self.num_speculative_tokens}
        return json.dumps(body, separators=(",", ":"))


def _int(body: dict, key: str, default: int | None, low: int, high: int) -> int:
    value = body.get(key, default)
    if value is None:
        raise ValueError(f"speculative_config needs {key!r}: e.g. "
                         '{"method": "ngram", "num_speculative_tokens": 4}')
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config {key}={value!r} is invalid: give an integer in "
                         f"[{low}, {high}]")
    return value


def parse_speculative_config(value: str | Mapping[str, Any] | SpeculativeConfig | None
                             ) -> SpeculativeConfig | None:
    """Gives the config `value` holds: `--speculative-config`'s JSON text, the same object
    as a dict, or a config already resolved (None when unset); raises ValueError naming the
    key, its value and the fix for anything else."""
    if value is None:
        return None
    if isinstance(value, SpeculativeConfig):  # built by hand: checked as its JSON would be
        return _resolve(json.loads(value.to_json()), repr(value))
    if isinstance(value, Mapping):
        return _resolve(dict(value), repr(dict(value)))
    if not isinstance(value, str):
        raise ValueError(f"speculative_config={value!r} is invalid: give a dict such as "
                         '{"method": "ngram", "num_speculative_tokens": 4}, its JSON text, or a '
                         "SpeculativeConfig")
    if not value.strip():
        return None
    try:
        body = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_config={value!r} is not JSON ({exc.msg}): write e.g. "
                         '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from exc
    if not isinstance(body, dict):
        raise ValueError(f"speculative_config={value!r} is not a JSON object")
    return _resolve(body, value)


def _resolve(body: dict[str, Any], given: str) -> SpeculativeConfig:
    """Gives the config of a parsed JSON object; `given` is how the user wrote it."""
    if any(not isinstance(key, str) for key in body):
        raise ValueError(f"speculative_config={given} has a key that is not a string: use "
                         f"{', '.join(_KEYS)}")
    unknown = sorted(set(body) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config key {unknown[0]!r} is not supported: use "
                         f"{', '.join(_KEYS)}")
    method = body.get("method", DRAFT if "model" in body else None)
    k = _int(body, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    if method == NGRAM:
        if "model" in body:
            raise ValueError("speculative_config 'model' does not go with method 'ngram': "
                             "drop one of them")
        high = _int(body, "prompt_lookup_max", 4, 1, 64)
        low = _int(body, "prompt_lookup_min", min(2, high), 1, 64)
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min={low} exceeds "
                             f"prompt_lookup_max={high}: lower the min or raise the max")
        return SpeculativeConfig(NGRAM, k, prompt_lookup_max=high, prompt_lookup_min=low)
    if method == DRAFT:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config model={model!r} is invalid: name the draft "
                             "model's directory, Hub id or built-in name")
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            if key in body:
                raise ValueError(f"speculative_config key {key!r} is for method 'ngram' only: "
                                 "drop it for a draft model")
        return SpeculativeConfig(DRAFT, k, model=model)
    raise ValueError(f"speculative_config method={method!r} is not supported: use 'ngram', or "
                     "give 'model' for a draft model")
