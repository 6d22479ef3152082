"""KV events as the router takes them, bounded so the prefix index's memory cap holds.

A `POST /kv_events` body, and each event an engine's `GET /kv_events` answers, is
`{"instance", "stored": [hash], "removed": [hash], "cleared", "tier"}`; `tier` is "gpu" (the
default: the GPU prefix cache) or "host" (the engine's host-memory tier, where a hit is
cheaper than a miss but dearer than a GPU hit). Every hash must be a
64-bit block hash (an int in [0, 2**64), what `block_hash` gives): the index's entry
cost (`prefix_index.ENTRY_BYTES`) assumes it, and a 4,000-digit "hash" would cost ten
times as much. A body holds at most `MAX_HASHES` hashes (an engine's whole event ring)
in at most `MAX_BODY_BYTES`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_HASHES = 65_536  # an engine's event ring (`core.kv_events`; the router ships without it)
MAX_BODY_BYTES = 2 * 2**20  # 65,536 hashes of 20 digits and their commas fit in 1.4 MB
MAX_INSTANCE_CHARS = 2048
BlockHash = Annotated[int, Field(strict=True, ge=0, le=2**64 - 1)]


class KVEvent(BaseModel):
    """One instance's change: blocks it cached and evicted, or its whole cache cleared."""

    model_config = ConfigDict(extra="forbid")

    instance: str = Field(default="", max_length=MAX_INSTANCE_CHARS)
    stored: list[BlockHash] = Field(default_factory=list, max_length=MAX_HASHES)
    removed: list[BlockHash] = Field(default_factory=list, max_length=MAX_HASHES)
    cleared: bool = Field(default=False, strict=True)
    tier: Literal["gpu", "host"] = "gpu"

    @model_validator(mode="after")
    def _bounded(self) -> KVEvent:
        total = len(self.stored) + len(self.removed)
        if total > MAX_HASHES:
            raise ValueError(f"stored and removed hold {total} hashes together: send at most "
                             f"{MAX_HASHES} per request")
        return self


def parse_event(raw: bytes | dict[str, Any]) -> KVEvent:
    """Gives the event in a JSON body (or a decoded one); raises ValueError naming the field,
    its value and the fix."""
    try:
        if isinstance(raw, dict):
            return KVEvent.model_validate(raw)
        return KVEvent.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        shown = repr(first.get("input"))
        shown = shown if len(shown) <= 40 else f"{shown[:37]}... ({len(shown)} characters)"
        hint = ("a block hash is an integer in [0, 2**64)"
                if field.startswith(("stored.", "removed.")) else
                'send {"instance": URL, "stored": [hash], "removed": [hash], "cleared": bool}')
        raise ValueError(f"{field}={shown} is invalid: {first['msg']}; {hint}") from exc
