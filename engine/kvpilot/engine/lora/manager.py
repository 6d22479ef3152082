"""The adapters an engine serves: their host copies by name, the device slots they take
(`LoRASlots`) and the copy of an adapter into its slot before a step uses it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.lora import parse_lora_modules
from kvpilot.engine.contracts.outputs import EngineStats
from kvpilot.engine.lora.layers import LoRAModel
from kvpilot.engine.lora.peft_adapter import PeftAdapter, load_peft_adapter
from kvpilot.engine.lora.slots import LoRASlots


class AdapterRequest(Protocol):
    """What the manager reads of a request (`core.request.Request`; lora/ sits below core)."""

    @property
    def lora_name(self) -> str | None:
        """The adapter the request runs with (None: the base model)."""
        ...


class LoRAManager:
    """Registry of the served adapters over the model's device slots."""

    def __init__(self, args: EngineArgs, model: LoRAModel) -> None:
        self.max_rank = args.max_lora_rank
        self.base_name = args.name  # what `model` names for the base model
        self.model = model
        self.slots = LoRASlots(args.max_loras)
        self.adapters: dict[str, PeftAdapter] = {}
        self.num_loads = 0  # copies of an adapter into a slot (tests read it)
        for name, path in parse_lora_modules(args.lora_modules).items():
            self.add(name, path)

    def add(self, name: str, path: str) -> None:
        """Reads and checks the adapter at `path` and serves it as `name`; raises ValueError
        naming the adapter and the fix when it cannot."""
        if name in self.adapters:
            raise ValueError(f"lora_name={name!r} is already loaded: unload it first, or "
                             "choose another name")
        if name == self.base_name:
            raise ValueError(f"lora_name={name!r} is the base model's name: give the adapter "
                             "another name")
        adapter = load_peft_adapter(name, path, self.max_rank)
        self.model.check(adapter)
        self.adapters[name] = adapter

    def remove(self, name: str) -> None:
        """Stops serving `name` and frees its slot (the caller checks no request uses it)."""
        if self.adapters.pop(name, None) is None:
            raise KeyError(name)
        slot = self.slots.slot_of(name)
        self.slots.release(name)
        if slot is not None:
            self.model.resident[slot] = None

    def in_use(self, name: str, requests: Iterable[AdapterRequest]) -> int:
        """Gives how many of `requests` run with adapter `name`."""
        return sum(r.lora_name == name for r in requests)

    def add_to(self, stats: EngineStats, running: Iterable[AdapterRequest],
               waiting: Iterable[AdapterRequest]) -> None:
        """Fills the LoRA fields of `stats` (vLLM's lora_requests_info gauge)."""
        stats.max_lora = self.slots.max_loras
        stats.running_lora_adapters = sorted({n for r in running if (n := r.lora_name)})
        stats.waiting_lora_adapters = sorted({n for r in waiting if (n := r.lora_name)})

    def device_slot(self, name: str) -> int:
        """Gives the slot of resident adapter `name`, copying its weights in if the slot
        holds another adapter's (the scheduler acquired the slot when it admitted)."""
        slot = self.slots.slot_of(name)
        if slot is None:
            raise AssertionError(f"adapter {name!r} is scheduled without a slot")
        if self.model.resident[slot] != name:
            self.model.load(slot, self.adapters[name])
            self.num_loads += 1
        return slot


def make_lora_manager(args: EngineArgs, model: LoRAModel | None) -> LoRAManager | None:
    """Gives the engine's LoRA manager over `model`'s slots (a single-rank runner's adapter
    layers; None on many ranks) with --enable-lora, else None."""
    if not args.enable_lora:
        return None
    if model is None:
        raise ValueError("enable_lora needs a single-rank model runner: run on one GPU "
                         "(tensor and pipeline parallel size 1)")
    return LoRAManager(args, model)


def unknown_adapter_fix(lora: LoRAManager | None) -> str:
    """Gives the fix for a request naming an adapter the engine does not serve."""
    if lora is None:
        return "this engine serves no adapters: start it with --enable-lora"
    loaded = ", ".join(sorted(lora.adapters)) or "none"
    return (f"use a loaded adapter ({loaded}) or load it with POST /v1/load_lora_adapter")
