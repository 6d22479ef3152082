"""The engine as its drivers see it: the step loop's calls, and what the core process reads.

`LLMEngine` implements both protocols; so do the role wrapper (`roles.RoleEngine`)
and the server tests' fake engine. The offline `LLM` drives an `EngineCore` in
its own thread; the engine core process (`core_process.proc.EngineCoreProc`)
serves a `ServedEngine` to the API server processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.outputs import EngineStats
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.core.kv_events import KVEventLog
from kvpilot.engine.core.outputs import EngineCoreOutput


class EngineCore(Protocol):
    """Add and abort requests, step, report: one thread drives it (not thread-safe)."""

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_name: str | None = None) -> None:
        """Queues a request (with LoRA adapter `lora_name`); raises ValueError naming the
        field when it is invalid."""
        ...

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Stops requests; each gets a final output with finish reason "abort"."""
        ...

    def step(self) -> list[EngineCoreOutput]:
        """Runs one step; gives the deltas of requests that progressed or ended."""
        ...

    def has_unfinished_requests(self) -> bool:
        """Gives whether a `step` has work (requests, or outputs still to return)."""
        ...

    def get_stats(self) -> EngineStats:
        """Gives the gauges and counters the server exports."""
        ...

    def step_timing(self) -> str:
        """Says where the last step's time went (for the slow-iteration log)."""
        ...


@runtime_checkable
class LoRAServing(Protocol):
    """An engine that loads and unloads LoRA adapters at run time (`LLMEngine`)."""

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serves the adapter at `lora_path` as `lora_name`; ValueError names the fix."""
        ...

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stops serving `lora_name`; KeyError when unknown, ValueError while in use."""
        ...

    def lora_adapters(self) -> dict[str, str]:
        """Gives the adapters served, name -> path."""
        ...


class ModelLimits(Protocol):
    """What the API server checks requests against."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


class ServedEngine(EngineCore, Protocol):
    """An EngineCore plus what the core process reads of it for the API servers."""

    @property
    def engine_args(self) -> EngineArgs: ...

    @property
    def model_config(self) -> ModelLimits: ...

    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def kv_events(self) -> KVEventLog:
        """Gives the prefix cache's event log, which GET /kv_events reads (without a lock)."""
        ...

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Has `callback(reason)` called, from another thread, if the engine breaks between
        steps (a tensor-parallel worker died): the core process then stops serving."""
        ...

    def shutdown(self) -> None:
        """Stops what runs beside the engine (a role engine's KV agent, TP workers)."""
        ...
