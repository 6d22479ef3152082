"""Which KV blocks each instance probably holds, and in which tier: an LRU map with a hard
entry cap.

Keys are (instance, block hash) pairs. Block hashes are chained (each covers its
parent), so an instance holding block i of a prompt holds the prompt's first
i + 1 blocks; a lookup walks the prompt's hashes from the start and stops at the
first miss. The index is fed by the router's own decisions (a request routed to
an instance will leave its prompt blocks cached there) and refined by KV events
the engines publish (blocks stored and evicted, in the GPU prefix cache or the
host-memory tier). An entry remembers both tiers: a block evicted from the GPU to
host memory stays known, as a host hit.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from kvpilot.engine.router.kv_events import KVEvent

GPU, HOST = 1, 2  # tier bits of an entry

# What one entry costs in CPython (OrderedDict node + key tuple + two ints),
# measured with tracemalloc (about 215 bytes with dict slack) in tests/router/test_router_prefix_index.py.
ENTRY_BYTES = 256


class PrefixIndex:
    """LRU set of (instance, block hash) pairs holding at most `max_entries`."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries!r} is invalid: must be at least 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, int], int] = OrderedDict()  # -> tier bits
        self._per_instance: Counter[str] = Counter()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def size(self, instance: str) -> int:
        """Gives how many blocks the index believes `instance` holds."""
        return self._per_instance[instance]

    def insert(self, instance: str, block_hashes: Iterable[int], tier: int = GPU) -> None:
        """Records that `instance` holds these blocks in `tier` (most recently used)."""
        entries = self._entries
        for block_hash in block_hashes:
            key = (instance, block_hash)
            if key in entries:
                entries[key] |= tier
                entries.move_to_end(key)
            else:
                entries[key] = tier
                self._per_instance[instance] += 1
                if len(entries) > self.max_entries:
                    (evicted, _), _ = entries.popitem(last=False)
                    self._per_instance[evicted] -= 1
                    self.evictions += 1

    def remove(self, instance: str, block_hashes: Iterable[int], tier: int = GPU) -> None:
        """Forgets blocks the instance evicted from `tier` (from its KV events)."""
        entries = self._entries
        for block_hash in block_hashes:
            key = (instance, block_hash)
            left = entries.get(key, 0) & ~tier
            if left:
                entries[key] = left
            elif entries.pop(key, None) is not None:
                self._per_instance[instance] -= 1

    def remove_instance(self, instance: str) -> None:
        """Forgets everything about an instance that left (or cleared its cache)."""
        for key in [key for key in self._entries if key[0] == instance]:
            del self._entries[key]
        self._per_instance.pop(instance, None)

    def apply(self, instance: str, event: KVEvent) -> None:
        """Applies one (validated) KV event of `instance`.

        `cleared` comes first (the engine forgot everything, or the reader fell behind
        its event ring), then removals, then stores, as in `POST /kv_events`.
        """
        tier = HOST if event.tier == "host" else GPU
        if event.cleared:
            self.remove_instance(instance)
        self.remove(instance, event.removed, tier)
        self.insert(instance, event.stored, tier)

    def match(self, instance: str, block_hashes: Sequence[int]) -> int:
        """Gives how many leading blocks of the prompt the instance holds (and touches them)."""
        return sum(self.match_tiers(instance, block_hashes))

    def match_tiers(self, instance: str, block_hashes: Sequence[int]) -> tuple[int, int]:
        """Gives (in the GPU cache, in host memory only) counts of the leading blocks of the
        prompt the instance holds (and touches them)."""
        entries = self._entries
        gpu = host = 0
        for block_hash in block_hashes:
            key = (instance, block_hash)
            tiers = entries.get(key)
            if tiers is None:
                break
            entries.move_to_end(key)
            if tiers & GPU:
                gpu += 1
            else:
                host += 1
        return gpu, host
