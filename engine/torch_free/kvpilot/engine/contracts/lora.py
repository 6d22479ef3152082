"""LoRA adapters' shared contract: `--lora-modules` parsing, the projections an adapter may
target, and the prefix-cache root of an adapter's block hashes; torch-free.

The operator renders `--lora-modules` from an InferenceModel's adapters, and the router
computes block hashes as the engine does, so both read this module rather than the engine.
"""

from __future__ import annotations

import hashlib

# the projections of a dense decoder layer an adapter may target (PEFT's module names)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj")


def parse_lora_modules(items: list[str] | None) -> dict[str, str]:
    """Gives {adapter name: path} of `--lora-modules name=path ...`; raises ValueError naming
    the item and the fix when one is malformed or a name repeats."""
    modules: dict[str, str] = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"lora_modules item {item!r} is invalid: write name=path, e.g. "
                             "--lora-modules sql-lora=/adapters/sql")
        if name in modules:
            raise ValueError(f"lora_modules names adapter {name!r} twice: give each adapter "
                             "a distinct name")
        modules[name] = path
    return modules


def lora_root_hash(lora_name: str | None) -> int | None:
    """Gives the parent hash of a sequence's first KV block: None for the base model, a hash
    of the adapter's name otherwise, so base and adapter blocks never share a hash."""
    if lora_name is None:
        return None
    digest = hashlib.blake2b(b"lora:" + lora_name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
