"""`LLM(model, **options)`'s keywords, written as vLLM users write them, resolved into `EngineArgs`.

vLLM's `LLM` takes the engine's options as keywords and its structured ones as dicts or
config objects (`speculative_config={"method": "ngram", "num_speculative_tokens": 4}`);
`kvpilot serve` takes the same options as flags, structured ones as text. One
`EngineArgs` serves both, because a tensor-parallel engine's workers start from its
`to_cli()`: the structured values are turned into their flag text here, after being
checked. A keyword that is no engine option is refused naming it (and the nearest
option), as is an unknown key inside a structured value. Torch-free.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.lora import parse_lora_modules
from kvpilot.engine.contracts.speculative import SpeculativeConfig, parse_speculative_config

OPTIONS = tuple(f.name for f in fields(EngineArgs) if f.name != "model")


def engine_args_of(model: str, options: Mapping[str, Any]) -> EngineArgs:
    """Gives the EngineArgs of `LLM(model, **options)`; raises ValueError naming the keyword
    (or the key inside a structured value) and the fix for anything it cannot take."""
    for key in options:
        if key not in OPTIONS:
            raise ValueError(f"LLM(..., {key}=...) is not an option of kvpilot's engine: "
                             f"{_nearest(key)}")
    resolved = dict(options)
    if "speculative_config" in resolved:
        resolved["speculative_config"] = _speculative_text(resolved["speculative_config"])
    if "lora_modules" in resolved:
        resolved["lora_modules"] = _lora_items(resolved["lora_modules"])
    if isinstance(resolved.get("kv_cache_memory"), int):  # bytes, as vLLM's kv_cache_memory_bytes
        resolved["kv_cache_memory"] = str(resolved["kv_cache_memory"])
    return EngineArgs(model=model, **resolved)


def _nearest(key: str) -> str:
    """Gives the fix for an unknown keyword: the options it resembles, else where they are."""
    close = difflib.get_close_matches(key, OPTIONS, n=2, cutoff=0.6)
    if close:
        return f"did you mean {' or '.join(close)}?"
    return ("the options are `kvpilot serve`'s flags with '_' for '-' (kvpilot serve --help); "
            "drop it")


def _speculative_text(value: Any) -> str | None:
    """Gives `--speculative-config`'s JSON for a dict, a SpeculativeConfig or JSON text."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str | Mapping | SpeculativeConfig):
        raise ValueError(f"speculative_config={value!r} is invalid: give a dict such as "
                         '{"method": "ngram", "num_speculative_tokens": 4} or a '
                         "SpeculativeConfig")
    config = parse_speculative_config(value)
    return config.to_json() if config is not None else None


def _lora_items(value: Any) -> list[str] | None:
    """Gives `--lora-modules`' name=path items for {name: path} or a list of such items."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        items = []
        for name, path in value.items():
            if not isinstance(name, str) or not isinstance(path, str):
                raise ValueError(f"lora_modules {{{name!r}: {path!r}}} is invalid: map each "
                                 "adapter name to its directory, e.g. {'sql': '/adapters/sql'}")
            items.append(f"{name}={path}")
    elif isinstance(value, list | tuple) and all(isinstance(i, str) for i in value):
        items = list(value)
    else:
        raise ValueError(f"lora_modules={value!r} is invalid: give {{name: path}} or a list "
                         "of 'name=path' items")
    parse_lora_modules(items)
    return items
