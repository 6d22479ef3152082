"""The typed messages between the API server processes and the engine core process.

msgspec Structs, msgpack-encoded, tagged so one decoder reads each direction.
They travel over one ZeroMQ socket pair per API server (`proc.py`, `client.py`).
The hot path is `StepOutputs`: one message per step per API server, holding
every one of its requests' deltas (`core.outputs.EngineCoreOutput`) and the
engine's stats, never cumulative copies.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpilot.engine.contracts.outputs import EngineStats
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.core.outputs import EngineCoreOutput

# ---- API server -> core ------------------------------------------------------------------


class Hello(msgspec.Struct, tag=True, array_like=True):
    """An API server's first message: the core sends it stats from now on."""


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """Queue a tokenised request (answered in the next `AddResults`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic(), the same clock in every process of the host
    priority: int = 0
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    """Stop these requests and free their KV blocks before the next step."""

    request_ids: list[str]


class KVEventsQuery(msgspec.Struct, tag=True, array_like=True):
    """GET /kv_events: the prefix cache's events since `since` (answered by `KVEvents`)."""

    query_id: int
    since: int


class LoRAAdapterQuery(msgspec.Struct, tag=True, array_like=True):
    """POST /v1/load_lora_adapter ("load"), /v1/unload_lora_adapter ("unload") or
    GET /v1/models ("list"), applied between steps (answered by `LoRAAdapterAnswer`)."""

    query_id: int
    op: str
    lora_name: str = ""
    lora_path: str = ""


# ---- core -> API server ------------------------------------------------------------------


class AddResults(msgspec.Struct, tag=True, array_like=True):
    """Which requests the engine took, and why it refused the others (ValueError text)."""

    accepted: list[str]
    rejected: list[tuple[str, str]]


class StepOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    """One step's deltas of the receiving API server's requests, and the engine's stats."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats


class KVEvents(msgspec.Struct, tag=True, array_like=True):
    """The answer to a `KVEventsQuery`: `KVEventLog.read`'s {"next": M, "events": [...]}."""

    query_id: int
    answer: dict[str, Any]


class LoRAAdapterAnswer(msgspec.Struct, tag=True, array_like=True):
    """The answer to a `LoRAAdapterQuery`: an HTTP status, the error text (empty on 200)
    and the adapters served after it, name -> path."""

    query_id: int
    status: int
    message: str
    adapters: dict[str, str]


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    """The engine raised; the core process exits after sending this."""

    message: str


ToCore = Hello | AddRequest | AbortRequests | KVEventsQuery | LoRAAdapterQuery
FromCore = AddResults | StepOutputs | KVEvents | LoRAAdapterAnswer | CoreFailed


def to_core_decoder() -> msgspec.msgpack.Decoder[ToCore]:
    """Gives the decoder of what API servers send the core."""
    return msgspec.msgpack.Decoder(ToCore)


def from_core_decoder() -> msgspec.msgpack.Decoder[FromCore]:
    """Gives the decoder of what the core sends an API server."""
    return msgspec.msgpack.Decoder(FromCore)
