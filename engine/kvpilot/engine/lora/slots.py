"""Which adapters hold the `--max-loras` device slots: a bounded LRU that never evicts an
adapter a running request uses; torch-free (the scheduler asks it before admitting)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set


class LoRASlots:
    """Adapter name -> slot, least recently used first."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slots: OrderedDict[str, int] = OrderedDict()

    def slot_of(self, name: str) -> int | None:
        """Gives the slot `name` holds, or None when it is not resident."""
        return self._slots.get(name)

    @property
    def resident(self) -> list[str]:
        """Gives the resident adapters, least recently used first."""
        return list(self._slots)

    def acquire(self, name: str, in_use: Set[str]) -> int | None:
        """Gives the slot of `name`, taking a free one or evicting the least recently used
        adapter outside `in_use`; None when every slot holds an adapter in use."""
        slot = self._slots.get(name)
        if slot is None:
            taken = set(self._slots.values())
            free = next((s for s in range(self.max_loras) if s not in taken), None)
            if free is None:
                victim = next((n for n in self._slots if n not in in_use), None)
                if victim is None:
                    return None
                free = self._slots.pop(victim)
            slot = self._slots[name] = free
        self._slots.move_to_end(name)
        return slot

    def release(self, name: str) -> None:
        """Frees the slot of `name` (an unloaded adapter), if it holds one."""
        self._slots.pop(name, None)
