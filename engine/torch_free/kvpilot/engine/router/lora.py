"""LoRA adapter affinity: which replicas hold an adapter, and which of them a request may go to.

An engine serving adapters exports vLLM's `vllm:lora_requests_info` gauge: the adapters of
its running and waiting requests and its slot count (`max_lora`) as labels, the time as the
value (vLLM adds a label set per change, so the newest sample is the current one). The rule,
llm-d's LoRA-affinity scorer made a filter before the load score:

- a request whose `model` names an adapter goes to the replicas that hold it (running or
  waiting), the policy picking among them by load (no prefix hits: the router hashes prompts
  as the base model, while engines root an adapter's block hashes at the adapter);
- unless the least-loaded holder's load (waiting + in flight) exceeds the least-loaded
  other replica's by more than `margin` (`--lora-affinity-margin`): then, as when no replica
  holds it, it goes to a replica without it that has a free adapter slot (fewer adapters
  than max_lora), else to any replica without it;
- a request for the base model (or any name no replica serves as an adapter) is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.contracts import metric_names as names
from kvpilot.engine.router.policy import InstanceView


@dataclass(frozen=True)
class LoraState:
    """One replica's adapters as its last /metrics scrape showed them."""

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_lora: int = 0

    @property
    def held(self) -> frozenset[str]:
        """Gives the adapters the replica holds (in a slot, or about to take one)."""
        return self.running | self.waiting

    @property
    def free_slot(self) -> bool:
        return len(self.held) < self.max_lora


def _names(text: str) -> frozenset[str]:
    return frozenset(n for n in (part.strip() for part in text.split(",")) if n)


def parse_lora(text: str) -> LoraState | None:
    """Gives the newest `vllm:lora_requests_info` sample of Prometheus text as a LoraState, or
    None when the engine exports none (LoRA off)."""
    newest = None
    for family in text_string_to_metric_families(text):
        if family.name != names.LORA_REQUESTS_INFO:
            continue
        for sample in family.samples:
            if newest is None or sample.value > newest.value:
                newest = sample
    if newest is None:
        return None
    labels = newest.labels
    try:
        max_lora = int(labels.get(names.MAX_LORA_LABEL, "0"))
    except ValueError:
        max_lora = 0
    return LoraState(_names(labels.get(names.RUNNING_LORA_ADAPTERS_LABEL, "")),
                     _names(labels.get(names.WAITING_LORA_ADAPTERS_LABEL, "")), max_lora)


def served_adapters(models: object) -> frozenset[str]:
    """Gives the adapter ids of a /v1/models answer: the cards with a `parent` (vLLM's)."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return frozenset()
    return frozenset(card["id"] for card in data if isinstance(card, dict)
                     and isinstance(card.get("id"), str) and card.get("parent"))


def lora_candidates(views: Sequence[InstanceView], states: Mapping[str, LoraState | None],
                    adapter: str, margin: float) -> tuple[list[InstanceView], str]:
    """Gives the replicas a request for `adapter` may go to and why: `affinity` (the holders),
    `overloaded` or `no_holder` (replicas with a free slot, else all)."""
    holders = [v for v in views if (s := states.get(v.url)) is not None and adapter in s.held]
    others = [v for v in views if v not in holders]
    if holders and (not others or min(v.load for v in holders)
                    <= min(v.load for v in others) + margin):
        return holders, "affinity"
    free = [v for v in others if (s := states.get(v.url)) is not None and s.free_slot]
    return free or list(others or views), "overloaded" if holders else "no_holder"
